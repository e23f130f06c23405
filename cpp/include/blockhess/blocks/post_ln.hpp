// The post-LN block (the paper's, docs/derivation.md §2.1, with the family's options):
//   Y = N_1(X + attn(X)),  Z = N_2(Y + ffn(Y)).
// Wiring only: every derivative comes from the nodes and the engine.
#pragma once

#include "blockhess/blocks/sublayers.hpp"

namespace blockhess::blocks {

template <class T>
Values wire_post_ln(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input, T eps) {
  Values v;
  v.X = input;
  const int F = attention_sublayer(g, s, D, p, v.X);
  v.attention_sum = g.add(std::make_unique<engine::ResidualNode<T>>("block: the residual X + F"), {v.X, F}, {}, D.d);
  const int Y = norm(g, s, p, 1, v.attention_sum, eps);
  const int G = ffn_sublayer(g, s, D, p, Y);
  v.ffn_sum = g.add(std::make_unique<engine::ResidualNode<T>>("block: the FFN output with its residual act(Y W_1) W_2 + Y"),
                    {G, Y}, {}, D.d);
  v.Z = norm(g, s, p, 2, v.ffn_sum, eps);
  return v;
}

}  // namespace blockhess::blocks
