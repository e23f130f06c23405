// The self-attention sublayer alone (the paper's Thm 1 setting, §4.1): Z = attn(X), with its
// heads, biases, W_O and causal mask as the spec has them; no residual, no norms, no FFN.
// Wiring only: every derivative comes from the nodes and the engine.
#pragma once

#include "blockhess/blocks/sublayers.hpp"

namespace blockhess::blocks {

template <class T>
Values wire_attention_only(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input) {
  Values v;  // attention_sum and ffn_sum stay -1: this block has neither
  v.X = input;
  v.Z = attention_sublayer(g, s, D, p, v.X);
  return v;
}

}  // namespace blockhess::blocks
