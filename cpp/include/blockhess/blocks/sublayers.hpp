// The pieces every block of the family is wired from: the attention sublayer (attention, then W_O),
// the FFN (W_1, the activation, W_2) and a norm, each taking its parameters from the registry
// (params.hpp) in the canonical order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/nodes/attention.hpp"
#include "blockhess/engine/nodes/layernorm.hpp"
#include "blockhess/engine/nodes/linear.hpp"
#include "blockhess/engine/nodes/pointwise.hpp"
#include "blockhess/engine/nodes/residual.hpp"
#include "blockhess/params.hpp"

namespace blockhess::blocks {

// The registered parameters, handed out in the canonical order as the wiring asks for them.
class ParamCursor {
 public:
  template <class T>
  ParamCursor(engine::Graph<T>& g, const std::vector<block::ParamShape>& shapes, const std::vector<const T*>& data) {
    if (shapes.size() != data.size()) throw std::invalid_argument("block: one array per parameter");
    for (size_t k = 0; k < shapes.size(); ++k) ids_.push_back(g.param(shapes[k].name, shapes[k].rows, shapes[k].cols, data[k]));
  }
  int next() { return ids_.at(next_++); }
  std::vector<int> next(int count) {
    std::vector<int> out;
    for (int k = 0; k < count; ++k) out.push_back(next());
    return out;
  }
  bool done() const { return next_ == ids_.size(); }

 private:
  std::vector<int> ids_;
  size_t next_ = 0;
};

template <class T>
int attention_sublayer(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input) {
  const index_t hv = s.heads * D.value_width(s);
  int F = g.add(std::make_unique<engine::AttentionNode<T>>(s.causal, s.heads), {input}, p.next(s.bias ? 6 : 3), hv);
  if (s.out_proj)
    F = g.add(std::make_unique<engine::LinearNode<T>>("block: the attention's output projection A V W_O"), {F},
              p.next(s.bias ? 2 : 1), D.d);
  return F;
}

template <class T>
int ffn_sublayer(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input) {
  const int H1 = g.add(std::make_unique<engine::LinearNode<T>>("block: the FFN pre-activations Y W_1"), {input},
                       p.next(s.bias ? 2 : 1), D.dff);
  const int R = g.add(std::make_unique<engine::PointwiseNode<T>>(s.activation), {H1}, {}, D.dff);
  return g.add(std::make_unique<engine::LinearNode<T>>("block: the FFN output act(Y W_1) W_2"), {R}, p.next(s.bias ? 2 : 1),
               D.d);
}

template <class T>
int norm(engine::Graph<T>& g, const block::Spec& s, ParamCursor& p, int input, T eps) {
  const std::vector<int> affine = s.norm_affine ? p.next(s.rmsnorm ? 1 : 2) : std::vector<int>{};
  return g.add(std::make_unique<engine::LayerNormNode<T>>(eps), {input}, affine, g.width(input));
}

// The values a caller may want by name (the reverse pass's checks name the stages they close).
struct Values {
  int X = -1, attention_sum = -1, ffn_sum = -1, Z = -1;
};

}  // namespace blockhess::blocks
