// A language model's input: each token's id looked up in the embedding W_E (vocab, d),
//   out_t = W_E[id_t]
// (learned positions are a node of their own after it: positions.hpp). Linear in its parameter and
// with no varying input, so it has no curvature of its own: a gradient scatters the cotangent's
// rows onto the rows of the ids, a tangent gathers them. W_E may be shared with a tied LM head
// (unembedding.hpp): its gradient and its rows of H v go through slots that sum both uses.
//
// Its per-token work is two row operations (GatherRows; ScatterRows, which sums each row's tokens in
// token order, so the gradient is deterministic on any backend).
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

#include "blockhess/backend_buffer.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows.hpp"

namespace blockhess::engine {

template <class T>
class EmbeddingNode final : public Node<T> {
 public:
  // ids: one per token (samples x L), each in [0, vocab), in the host's memory; copied (the node
  // may outlive them), with the tokens grouped by id for the gradient's scatter. Null in a graph
  // wired for its shapes only (Graph::input).
  EmbeddingNode(const std::int64_t* ids, index_t tokens, index_t vocab) : ids_(ids, ids ? ids + tokens : ids) {
    for (const std::int64_t id : ids_)
      if (id < 0 || id >= vocab)
        throw std::invalid_argument("embedding: token id " + std::to_string(id) + " is out of range [0, " +
                                    std::to_string(vocab) + ")");
    group_by_id();
  }

  // W_E's rows looked up by the tokens' ids (LinearUse).
  LinearUse<T> linear_use(const Graph<T>& g, int) const override { return {nullptr, g.cotangent(this->output), ids_.data()}; }

  // The ids and their grouping (four int64 arrays of at most a token's count), on the host and in
  // the backend's memory, in values of T.
  Footprint footprint(const Graph<T>& g) const override {
    return {8 * g.tokens() * static_cast<index_t>(sizeof(std::int64_t) / sizeof(T)), 0, 0, 0};
  }

  void forward(Graph<T>& g) override {
    const Backend<T>& backend = g.backend();
    on_backend_.ids.assign(backend, ids_.data(), static_cast<index_t>(ids_.size()));
    on_backend_.used.assign(backend, used_.data(), static_cast<index_t>(used_.size()));
    on_backend_.starts.assign(backend, starts_.data(), static_cast<index_t>(starts_.size()));
    on_backend_.order.assign(backend, order_.data(), static_cast<index_t>(order_.size()));
    gather(g, g.weight(param()), g.value_out(this->output));
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
    if (dE) gather(g, dE, tg.out(this->output, g.tokens() * g.width(this->output)));
  }

  // Linear in its parameter: the tangent of its gradient is the cotangent's tangent scattered.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    scatter(g, tg.dgrad_slot(param()), tg.dcot[static_cast<size_t>(this->output)].data());
  }

 private:
  int param() const { return this->params[0]; }

  // The tokens grouped by id for the scatter: used_ the ids that occur, ascending; the tokens of
  // used_[u] are order_[starts_[u] .. starts_[u + 1]), in token order.
  void group_by_id() {
    const index_t n = static_cast<index_t>(ids_.size());
    order_.resize(static_cast<size_t>(n));
    for (index_t t = 0; t < n; ++t) order_[static_cast<size_t>(t)] = t;
    std::stable_sort(order_.begin(), order_.end(),
                     [this](std::int64_t a, std::int64_t b) { return ids_[static_cast<size_t>(a)] < ids_[static_cast<size_t>(b)]; });
    for (index_t i = 0; i < n; ++i) {
      const std::int64_t id = ids_[static_cast<size_t>(order_[static_cast<size_t>(i)])];
      if (used_.empty() || used_.back() != id) {
        used_.push_back(id);
        starts_.push_back(i);
      }
    }
    starts_.push_back(n);
  }

  // Each token's row of `table` (vocab, d) into `out` (tokens, d).
  void gather(const Graph<T>& g, const T* table, T* out) const {
    const index_t d = g.width(this->output);
    g.backend().run(rows::GatherRows<T>{table, on_backend_.ids.data(), out, d}, g.tokens() * d);
  }

  // Adds each token's row of `rows` (tokens, d) onto W_E's row of its id; the slot's other rows are
  // zero where it is written first.
  void scatter(const Graph<T>& g, const Slot<T>& slot, const T* rows) const {
    if (!slot.data) return;
    const index_t d = g.width(this->output), count = static_cast<index_t>(used_.size());
    if (!slot.add) g.backend().run(rows::Zero<T>{slot.data}, g.parameter(param()).size());
    if (count == 0) return;
    g.backend().run(rows::ScatterRows<T>{rows, on_backend_.used.data(), on_backend_.starts.data(),
                                         on_backend_.order.data(), slot.data, d, (g.tokens() + count - 1) / count},
                    count * d);
  }

  std::vector<std::int64_t> ids_, used_, starts_, order_;
  struct {  // the same in the backend's memory (forward)
    BackendBuffer<T, std::int64_t> ids, used, starts, order;
  } on_backend_;
};

}  // namespace blockhess::engine
