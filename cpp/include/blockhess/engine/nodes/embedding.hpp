// A language model's input: each token's id looked up in the embedding W_E (vocab, d),
//   out_t = W_E[id_t]
// (learned positions are a node of their own after it: positions.hpp). Linear in its parameter and
// with no varying input, so it has no curvature of its own: a gradient scatters the cotangent's
// rows onto the rows of the ids, a tangent gathers them. W_E may be shared with a tied LM head
// (unembedding.hpp): its gradient and its rows of H v go through slots that sum both uses.
//
// W_E moves every token's input to the first block's attention, which mixes tokens: the per-token
// factors of a dense Hessian or diagonal do not cover it yet (the attention node's refusal), and
// push() refuses it here with the same advice.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/engine/graph.hpp"

namespace blockhess::engine {

template <class T>
class EmbeddingNode final : public Node<T> {
 public:
  // ids: one per token (samples x L), each in [0, vocab); copied (the node may outlive them). Null
  // in a graph wired for its shapes only (Graph::input).
  EmbeddingNode(const std::int64_t* ids, index_t tokens, index_t vocab) : ids_(ids, ids ? ids + tokens : ids) {
    for (const std::int64_t id : ids_)
      if (id < 0 || id >= vocab)
        throw std::invalid_argument("embedding: token id " + std::to_string(id) + " is out of range [0, " +
                                    std::to_string(vocab) + ")");
  }

  // W_E's rows looked up by the tokens' ids (LinearUse).
  LinearUse<T> linear_use(const Graph<T>& g, int) const override { return {nullptr, g.cotangent(this->output), ids_.data()}; }

  // The ids it copied.
  Footprint footprint(const Graph<T>& g) const override { return {g.tokens(), 0, 0, 0}; }

  void forward(Graph<T>& g) override {
    g.require_host("an embedding lookup");
    const index_t n = g.tokens(), d = g.width(this->output);
    const T* E = g.weight(param());
    T* out = g.value_out(this->output);
    for (index_t t = 0; t < n; ++t) std::copy_n(E + ids_[static_cast<size_t>(t)] * d, d, out + t * d);
  }

  void vjp(Graph<T>& g) const override { scatter(g, g.gradient_slot(param()), g.cotangent(this->output)); }

  void push(Graph<T>& g) const override {
    if (g.selected(param()))
      throw FactorsDoNotReach("engine: " + g.parameter(param()).name + " moves every token's input to the attention, "
                              "which mixes tokens: the per-token factors do not reach it");
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* dE = tg.dW[static_cast<size_t>(param())];
    if (!dE) return;
    const index_t n = g.tokens(), d = g.width(this->output);
    T* out = tg.out(this->output, n * d);
    for (index_t t = 0; t < n; ++t) std::copy_n(dE + ids_[static_cast<size_t>(t)] * d, d, out + t * d);
  }

  // Linear in its parameter: the tangent of its gradient is the cotangent's tangent scattered.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    scatter(g, tg.dgrad_slot(param()), tg.dcot[static_cast<size_t>(this->output)].data());
  }

 private:
  int param() const { return this->params[0]; }

  // Adds each token's row of `rows` (tokens, d) onto W_E's row of its id; the slot's other rows are
  // zero where it is written first.
  void scatter(const Graph<T>& g, const Slot<T>& slot, const T* rows) const {
    if (!slot.data) return;
    const index_t n = g.tokens(), d = g.width(this->output);
    if (!slot.add) std::fill_n(slot.data, g.parameter(param()).size(), T(0));
    for (index_t t = 0; t < n; ++t) {
      T* row = slot.data + ids_[static_cast<size_t>(t)] * d;
      for (index_t a = 0; a < d; ++a) row[a] += rows[t * d + a];
    }
  }

  std::vector<std::int64_t> ids_;
};

}  // namespace blockhess::engine
