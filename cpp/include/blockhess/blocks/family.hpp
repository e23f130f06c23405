// Blocks of the family (params.hpp's Spec) wired onto an engine graph: one block on any value of
// width d (wire_block), which chains; a lone block on its input X (wire); a stack of blocks, each
// taking its own layer's parameters, and its final norm (wire_stack).
#pragma once

#include <string>
#include <vector>

#include "blockhess/blocks/attention_only.hpp"
#include "blockhess/blocks/post_ln.hpp"
#include "blockhess/blocks/pre_ln.hpp"

namespace blockhess::blocks {

// One block on `input`, its parameters the cursor's current layer's; returns its values (Z its output).
template <class T>
Values wire_block(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, ParamCursor& p, int input, T eps) {
  const Values v = s.attention_only                               ? wire_attention_only(g, s, D, p, input)
                   : s.norm_position == block::NormPosition::pre ? wire_pre_ln(g, s, D, p, input, eps)
                                                                 : wire_post_ln(g, s, D, p, input, eps);
  // The reverse pass names the stage where it overflows: behind the output's norm, or behind the
  // FFN and the first norm (the attention-only block has neither).
  if (v.ffn_sum >= 0) {
    g.check_cotangent(v.ffn_sum, "block: the reverse pass through the output's norm");
    g.check_cotangent(v.attention_sum, "block: the reverse pass through the FFN and the first norm");
  }
  return v;
}

// The stack's blocks on X, the output of each the input of the next (one layer: the block itself),
// then its final norm if it has one. weights: one array per block::parameters(s, D, stack) entry,
// in that order. Returns the values of the last block, Z the stack's output.
template <class T>
Values wire_stack(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, const block::Stack& stack,
                  const T* X, const std::vector<const T*>& weights, T eps,
                  engine::Storage storage = engine::Storage::copy) {
  block::check(s, D);
  ParamCursor p(g, block::parameters(s, D, stack), weights, storage);
  Values v;
  v.Z = g.input(X, D.d);
  for (index_t l = 0; l < stack.layers; ++l) {
    p.enter(block::layer_prefix(stack.layers, l));
    v = wire_block(g, s, D, p, v.Z, eps);
  }
  if (stack.final_norm) {
    p.enter("");
    v.Z = norm(g, s, p, "ln_f.gamma", "ln_f.beta", v.Z, eps);
  }
  if (!p.done()) throw std::logic_error("block: the wiring left parameters unused");
  g.set_output(v.Z);
  return v;
}

// The block on X: its input, the block, its output.
template <class T>
Values wire(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, const T* X,
            const std::vector<const T*>& weights, T eps, engine::Storage storage = engine::Storage::copy) {
  return wire_stack(g, s, D, block::Stack{}, X, weights, eps, storage);
}

}  // namespace blockhess::blocks
