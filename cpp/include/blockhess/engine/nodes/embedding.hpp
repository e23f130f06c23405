// A language model's input: each token's id looked up in the embedding W_E (vocab, d), plus, with
// learned positions, row i of W_P (positions, d) for the token at position i of its sample:
//   out_t = W_E[id_t] + W_P[t mod L].
// Linear in its parameters and with no varying input, so it has no curvature of its own: a
// gradient scatters the cotangent's rows onto the rows of the ids (and positions), a tangent
// gathers them. W_E may be shared with a tied LM head (unembedding.hpp): its gradient and its
// rows of H v go through slots that sum both uses.
//
// Its parameters move every token's input to the first block's attention, which mixes tokens: the
// per-token factors of a dense Hessian or diagonal do not cover them yet (the attention node's
// refusal), and push() refuses them here with the same advice.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/engine/graph.hpp"

namespace blockhess::engine {

template <class T>
class EmbeddingNode final : public Node<T> {
 public:
  // ids: one per token (samples x L), each in [0, vocab); copied (the node may outlive them).
  EmbeddingNode(const std::int64_t* ids, index_t tokens, index_t vocab) : ids_(ids, ids + tokens) {
    for (const std::int64_t id : ids_)
      if (id < 0 || id >= vocab)
        throw std::invalid_argument("embedding: token id " + std::to_string(id) + " is out of range [0, " +
                                    std::to_string(vocab) + ")");
  }

  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), d = g.width(this->output), L = g.tokens_per_sample();
    const T* E = g.weight(embedding());
    T* out = g.value_out(this->output);
    for (index_t t = 0; t < n; ++t) {
      const T* row = E + ids_[static_cast<size_t>(t)] * d;
      const T* pos = has_positions() ? g.weight(positions()) + (t % L) * d : nullptr;
      for (index_t a = 0; a < d; ++a) out[t * d + a] = pos ? row[a] + pos[a] : row[a];
    }
  }

  void vjp(Graph<T>& g) const override {
    const T* gout = g.cotangent(this->output);
    scatter(g, g.gradient_slot(embedding()), gout, true);
    if (has_positions()) scatter(g, g.gradient_slot(positions()), gout, false);
  }

  void push(Graph<T>& g) const override {
    for (int p : this->params)
      if (g.selected(p))
        throw std::invalid_argument("engine: " + g.parameter(p).name + " moves every token's input to the attention, "
                                    "which mixes tokens: its dense Hessian and diagonal are not available yet; "
                                    "Hessian-vector products (loss_hvp, the operator) are exact there");
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* dE = tg.dW[static_cast<size_t>(embedding())];
    const T* dP = has_positions() ? tg.dW[static_cast<size_t>(positions())] : nullptr;
    if (!dE && !dP) return;
    const index_t n = g.tokens(), d = g.width(this->output), L = g.tokens_per_sample();
    T* out = tg.out(this->output, n * d);
    for (index_t t = 0; t < n; ++t)
      for (index_t a = 0; a < d; ++a)
        out[t * d + a] = (dE ? dE[ids_[static_cast<size_t>(t)] * d + a] : T(0)) + (dP ? dP[(t % L) * d + a] : T(0));
  }

  // Linear in its parameters: the tangent of its gradient is the cotangent's tangent scattered.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    const T* dgout = tg.dcot[static_cast<size_t>(this->output)].data();
    scatter(g, tg.dgrad_slot(embedding()), dgout, true);
    if (has_positions()) scatter(g, tg.dgrad_slot(positions()), dgout, false);
  }

  bool parameters_move_alike() const override { return false; }

 private:
  int embedding() const { return this->params[0]; }
  bool has_positions() const { return this->params.size() > 1; }
  int positions() const { return this->params[1]; }

  // Adds each token's row of `rows` (tokens, d) onto the parameter's row of its id (by_id) or of
  // its position; the slot's other rows are zero where it is written first.
  void scatter(const Graph<T>& g, const Slot<T>& slot, const T* rows, bool by_id) const {
    if (!slot.data) return;
    const int p = by_id ? embedding() : positions();
    const index_t n = g.tokens(), d = g.width(this->output), L = g.tokens_per_sample();
    if (!slot.add) std::fill_n(slot.data, g.parameter(p).size(), T(0));
    for (index_t t = 0; t < n; ++t) {
      T* row = slot.data + (by_id ? ids_[static_cast<size_t>(t)] : t % L) * d;
      for (index_t a = 0; a < d; ++a) row[a] += rows[t * d + a];
    }
  }

  std::vector<std::int64_t> ids_;
};

}  // namespace blockhess::engine
