// Blocks of the family (params.hpp's Spec) wired onto an engine graph: one block on any value of
// width d (wire_block), which chains; a lone block on its input X (wire); a model (params.hpp's
// Stack): its input (X, a token embedding, or a patch embedding and class token) and learned
// positions, its blocks, each taking its own layer's parameters, its final norm, and its tied LM
// head or classifier (wire_stack).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "blockhess/blocks/attention_only.hpp"
#include "blockhess/blocks/post_ln.hpp"
#include "blockhess/blocks/pre_ln.hpp"
#include "blockhess/engine/nodes/class_token.hpp"
#include "blockhess/engine/nodes/embedding.hpp"
#include "blockhess/engine/nodes/positions.hpp"
#include "blockhess/engine/nodes/unembedding.hpp"

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

// What a model reads: X (samples x L x d) for a stack of blocks, or (samples x L x patch_dim) for a
// ViT's patch embedding, or the token ids (samples x L) of a language model (Stack::vocab > 0).
// shapes_only: neither, for a graph wired for its shapes only (engine/working_memory.hpp).
template <class T>
struct Input {
  const T* X = nullptr;
  const std::int64_t* ids = nullptr;
  bool shapes_only = false;
};

// The model's input value: X, its patches' embedding, or the ids' (wte's id into *wte); then the
// learned positions.
template <class T>
int wire_input(engine::Graph<T>& g, const block::Dims& D, const block::Stack& stack, const Input<T>& in,
               ParamCursor& p, int* wte) {
  if (stack.positions > 0 && D.L > stack.positions)
    throw std::invalid_argument("model: " + std::to_string(D.L) + " tokens per sample, but wpe has only " +
                                std::to_string(stack.positions) + " positions");
  int x = -1;
  if (stack.reads_tokens()) {
    if (!in.ids && !in.shapes_only) throw std::invalid_argument("model: a language model reads token ids");
    *wte = p.take("wte");
    x = g.add(std::make_unique<engine::EmbeddingNode<T>>(in.ids, g.tokens(), stack.vocab), {}, {*wte}, D.d);
  } else {
    if (!in.X && !in.shapes_only) throw std::invalid_argument("block: X is missing");
    x = g.input(in.X, stack.reads_patches() ? stack.patch_dim : D.d);
    if (stack.reads_patches())
      x = g.add(std::make_unique<engine::LinearNode<T>>("model: the patch embedding"), {x},
                {p.take("W_E"), p.take("b_E")}, D.d);
    if (stack.class_token) x = g.add(std::make_unique<engine::ClassTokenNode<T>>(), {x}, {p.take("cls_token")}, D.d);
  }
  if (stack.positions > 0) x = g.add(std::make_unique<engine::PositionsNode<T>>(), {x}, {p.take("wpe")}, D.d);
  return x;
}

// The model on its input: the input (or embedding), its blocks, the output of each the input of
// the next (one layer: the block itself), its final norm and its LM head or classifier, as the
// Stack has them. weights: one array per block::parameters(s, D, stack) entry, in that order.
// Returns the values of the last block, Z the model's output.
template <class T>
Values wire_stack(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, const block::Stack& stack,
                  const Input<T>& in, const std::vector<const T*>& weights, T eps,
                  engine::Storage storage = engine::Storage::copy) {
  block::check(s, D);
  ParamCursor p(g, block::parameters(s, D, stack), weights, storage);
  Values v;
  int wte = -1;
  v.Z = wire_input(g, D, stack, in, p, &wte);
  for (index_t l = 0; l < stack.layers; ++l) {
    p.enter(block::layer_prefix(stack.layers, l));
    v = wire_block(g, s, D, p, v.Z, eps);
  }
  p.enter("");
  if (stack.final_norm) v.Z = norm(g, s, p, "ln_f.gamma", "ln_f.beta", v.Z, eps);
  if (stack.lm_head) v.Z = g.add(std::make_unique<engine::UnembeddingNode<T>>(), {v.Z}, {wte}, stack.vocab);
  if (stack.classes > 0)
    v.Z = g.add(std::make_unique<engine::LinearNode<T>>("model: the classifier's logits"), {v.Z},
                {p.take("W_C"), p.take("b_C")}, stack.classes);
  if (!p.done()) throw std::logic_error("block: the wiring left parameters unused");
  g.set_output(v.Z);
  return v;
}

// The block on X: its input, the block, its output.
template <class T>
Values wire(engine::Graph<T>& g, const block::Spec& s, const block::Dims& D, const T* X,
            const std::vector<const T*>& weights, T eps, engine::Storage storage = engine::Storage::copy) {
  return wire_stack(g, s, D, block::Stack{}, Input<T>{X, nullptr}, weights, eps, storage);
}

}  // namespace blockhess::blocks
