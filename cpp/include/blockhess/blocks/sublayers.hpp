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

// The registered parameters, handed out by name as the wiring asks for them (the registry's order,
// which is also the Hessian's, need not be the order in which a wiring meets them: a pre-LN block
// meets gamma_1 before W_Q).
class ParamCursor {
 public:
  template <class T>
  ParamCursor(engine::Graph<T>& g, const std::vector<block::ParamShape>& shapes, const std::vector<const T*>& data,
              engine::Storage storage) {
    if (shapes.size() != data.size()) throw std::invalid_argument("block: one array per parameter");
    for (size_t k = 0; k < shapes.size(); ++k) {
      names_.push_back(shapes[k].name);
      ids_.push_back(g.param(shapes[k].name, shapes[k].rows, shapes[k].cols, data[k], storage));
    }
    taken_.assign(ids_.size(), false);
  }
  // The block being wired takes the parameters named `prefix` + its own names (a stack's layer
  // "h.3."; "" for a lone block).
  void enter(std::string prefix) { prefix_ = std::move(prefix); }
  int take(const std::string& name) {
    const std::string full = prefix_ + name;
    for (size_t k = 0; k < names_.size(); ++k)
      if (names_[k] == full) {
        if (taken_[k]) throw std::logic_error("block: the wiring takes " + full + " twice");
        taken_[k] = true;
        return ids_[k];
      }
    throw std::logic_error("block: the wiring asks for " + full + ", which the registry does not list");
  }
  // The parameters among `names` that the spec has, in that order.
  std::vector<int> take_present(std::initializer_list<const char*> names) {
    std::vector<int> out;
    for (const char* name : names)
      if (has(name)) out.push_back(take(name));
    return out;
  }
  bool has(const std::string& name) const {
    for (const std::string& n : names_)
      if (n == prefix_ + name) return true;
    return false;
  }
  bool done() const {
    for (bool t : taken_)
      if (!t) return false;
    return true;
  }

 private:
  std::vector<std::string> names_;
  std::vector<int> ids_;
  std::vector<bool> taken_;
  std::string prefix_;
};

template <class T>
int attention_sublayer(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input) {
  const index_t hv = s.heads * D.value_width(s);
  int F = g.add(std::make_unique<engine::AttentionNode<T>>(s.causal, s.heads), {input},
                p.take_present({"W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V"}), hv);
  if (s.out_proj)
    F = g.add(std::make_unique<engine::LinearNode<T>>("block: the attention's output projection A V W_O"), {F},
              p.take_present({"W_O", "b_O"}), D.d);
  return F;
}

template <class T>
int ffn_sublayer(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input) {
  const int H1 = g.add(std::make_unique<engine::LinearNode<T>>("block: the FFN pre-activations Y W_1"), {input},
                       p.take_present({"W_1", "b_1"}), D.dff);
  const int R = g.add(std::make_unique<engine::PointwiseNode<T>>(s.activation), {H1}, {}, D.dff);
  return g.add(std::make_unique<engine::LinearNode<T>>("block: the FFN output act(Y W_1) W_2"), {R},
               p.take_present({"W_2", "b_2"}), D.d);
}

// A norm of the spec's kind, LayerNorm or RMSNorm, with its parameters `gamma` (and `beta`) when the
// spec has them.
template <class T>
int norm(engine::Graph<T>& g, const block::Spec& s, ParamCursor& p, const std::string& gamma,
         const std::string& beta, int input, T eps) {
  std::vector<int> affine = p.take_present({gamma.c_str(), beta.c_str()});
  if (s.norm == block::Norm::rmsnorm) return g.add(std::make_unique<engine::RmsNormNode<T>>(eps), {input}, std::move(affine), g.width(input));
  return g.add(std::make_unique<engine::LayerNormNode<T>>(eps), {input}, std::move(affine), g.width(input));
}

// The block's norm k (1 or 2), with its gamma_k (and beta_k).
template <class T>
int norm(engine::Graph<T>& g, const block::Spec& s, ParamCursor& p, int k, int input, T eps) {
  return norm(g, s, p, "gamma_" + std::to_string(k), "beta_" + std::to_string(k), input, eps);
}

// The values a caller may want by name (the reverse pass's checks name the stages they close): X
// is the block's input, Z its output.
struct Values {
  int X = -1, attention_sum = -1, ffn_sum = -1, Z = -1;
};

}  // namespace blockhess::blocks
