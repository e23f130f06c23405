// The pre-LN block (GPT-2's layout): Y = X + attn(N_1(X)),  Z = Y + ffn(N_2(Y)).
// Wiring only: every derivative comes from the nodes and the engine.
#pragma once

#include "blockhess/blocks/sublayers.hpp"

namespace blockhess::blocks {

template <class T>
Values wire_pre_ln(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input, T eps) {
  Values v;
  v.X = input;
  const int F = attention_sublayer(g, s, D, p, norm(g, s, p, 1, v.X, eps));
  v.attention_sum = g.add(std::make_unique<engine::ResidualNode<T>>("block: the residual X + F"), {v.X, F}, {}, D.d);
  const int G = ffn_sublayer(g, s, D, p, norm(g, s, p, 2, v.attention_sum, eps));
  v.ffn_sum = g.add(std::make_unique<engine::ResidualNode<T>>("block: the FFN output with its residual Y + ffn(N_2(Y))"),
                    {v.attention_sum, G}, {}, D.d);
  v.Z = v.ffn_sum;
  return v;
}

}  // namespace blockhess::blocks
