// The paper's post-LN block (docs/derivation.md §2.1) as a wiring of engine nodes:
//   F = attention(X; W_Q, W_K, W_V),  Y = LN(X + F),  S = relu(Y W_1) W_2 + Y,  Z = LN(S).
// Wiring only: every derivative comes from the nodes and the engine.
#pragma once

#include <memory>

#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/nodes/attention.hpp"
#include "blockhess/engine/nodes/layernorm.hpp"
#include "blockhess/engine/nodes/linear.hpp"
#include "blockhess/engine/nodes/pointwise.hpp"
#include "blockhess/engine/nodes/residual.hpp"
#include "blockhess/params.hpp"

namespace blockhess::blocks {

// The values a caller may want by name (the reverse pass's checks name the stages they close).
struct PostLnValues {
  int X = -1, F = -1, S1 = -1, Y = -1, S = -1, Z = -1;
};

template <class T>
PostLnValues wire_post_ln(engine::Graph<T>& g, const block::Dims& D, const T* X,
                          const std::array<const T*, block::kNumParams>& weights, T eps) {
  using namespace engine;
  PostLnValues v;
  std::array<int, block::kNumParams> p{};
  for (int k = 0; k < block::kNumParams; ++k) p[k] = g.param(block::kParamNames[k], D.rows(k), D.cols(k), weights[k]);
  const index_t d = D.d, dff = D.dff;
  v.X = g.input(X, d);
  v.F = g.add(std::make_unique<AttentionNode<T>>(), {v.X}, {p[block::W_Q], p[block::W_K], p[block::W_V]}, d);
  v.S1 = g.add(std::make_unique<ResidualNode<T>>("block: the residual X + F"), {v.X, v.F}, {}, d);
  v.Y = g.add(std::make_unique<LayerNormNode<T>>(eps), {v.S1}, {}, d);
  const int H1 = g.add(std::make_unique<LinearNode<T>>("block: the FFN pre-activations Y W_1"), {v.Y}, {p[block::W_1]}, dff);
  const int R = g.add(std::make_unique<PointwiseNode<T>>(activation::Kind::relu), {H1}, {}, dff);
  const int G = g.add(std::make_unique<LinearNode<T>>("block: the FFN output relu(Y W_1) W_2"), {R}, {p[block::W_2]}, d);
  v.S = g.add(std::make_unique<ResidualNode<T>>("block: the FFN output with its residual relu(Y W_1) W_2 + Y"), {G, v.Y},
              {}, d);
  v.Z = g.add(std::make_unique<LayerNormNode<T>>(eps), {v.S}, {}, d);
  g.set_output(v.Z);
  return v;
}

}  // namespace blockhess::blocks
