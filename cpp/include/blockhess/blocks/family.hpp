// A block of the family (params.hpp's Spec) wired onto an engine graph.
#pragma once

#include <vector>

#include "blockhess/blocks/attention_only.hpp"
#include "blockhess/blocks/post_ln.hpp"
#include "blockhess/blocks/pre_ln.hpp"

namespace blockhess::blocks {

template <class T>
Values wire(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, const T* X,
            const std::vector<const T*>& weights, T eps, engine::Storage storage = engine::Storage::copy) {
  block::check(s, D);
  ParamCursor p(g, block::parameters(s, D), weights, storage);
  const Values v = s.attention_only ? wire_attention_only(g, s, D, p, X)
                   : s.norm_position == block::NormPosition::pre ? wire_pre_ln(g, s, D, p, X, eps)
                                    : wire_post_ln(g, s, D, p, X, eps);
  if (!p.done()) throw std::logic_error("block: the wiring left parameters unused");
  // The reverse pass names the stage where it overflows: behind the output's norm, or behind the
  // FFN and the first norm (the attention-only block has neither).
  if (v.ffn_sum >= 0) {
    g.check_cotangent(v.ffn_sum, "block: the reverse pass through the output's norm");
    g.check_cotangent(v.attention_sum, "block: the reverse pass through the FFN and the first norm");
  }
  return v;
}

}  // namespace blockhess::blocks
