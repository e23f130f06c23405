// A ViT's class token: the first token of every sample is the learned vector c (1, d) instead of
// its input row (the model reads its patches from position 1 on; position 0's input is a
// placeholder), out_{b,0} = c, out_{b,i} = in_{b,i} for i >= 1. Linear, no curvature: c's gradient
// is the sum of the cotangent's first rows, the input's cotangent has them zeroed, a tangent writes
// dc there.
//
// c, and every parameter below it, moves the first block's attention input, which mixes tokens:
// the per-token factors do not reach them, and push() says so (FactorsDoNotReach: their dense
// Hessian and diagonal come from Hessian-vector products, loss.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"

namespace blockhess::engine {

template <class T>
class ClassTokenNode final : public Node<T> {
 public:
  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), d = width(g), L = g.tokens_per_sample();
    rows_.resize(static_cast<size_t>(n));
    for (index_t t = 0; t < n; ++t) rows_[static_cast<size_t>(t)] = t % L == 0 ? 0 : -1;
    g.backend().run(rows::ClassTokenRows<T>{g.weight(param()), g.value(this->inputs[0]), g.value_out(this->output), false,
                                            L * d, d},
                    n * d);
  }

  void vjp(Graph<T>& g) const override {
    const T* gout = g.cotangent(this->output);
    if (g.varies(this->inputs[0])) write_masked(g, g.cotangent_slot(this->inputs[0]), gout);
    first_rows_sum(g, g.gradient_out(param()), gout);
  }

  void push(Graph<T>& g) const override {
    bool moved = g.selected(param());
    for (const Factor<T>* f : g.factors(this->inputs[0])) moved = moved || f->present;
    if (moved)
      throw FactorsDoNotReach("engine: the class token and the patch embedding move every token's input to the "
                              "attention, which mixes tokens: the per-token factors do not reach them");
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  // c is a table of one row that every sample's first token looks up (LinearUse), the others none.
  LinearUse<T> linear_use(const Graph<T>& g, int) const override { return {nullptr, g.cotangent(this->output), rows_.data()}; }
  Footprint footprint(const Graph<T>& g) const override { return {g.tokens(), 0, 0, 0}; }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(this->inputs[0]);
    const T* dc = tg.dW[static_cast<size_t>(param())];
    if (!din && !dc) return;
    const index_t n = g.tokens(), d = width(g), L = g.tokens_per_sample();
    g.backend().run(rows::ClassTokenRows<T>{dc, din, tg.out(this->output, n * d), false, L * d, d}, n * d);
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    const T* dgout = tg.dcot[static_cast<size_t>(this->output)].data();
    if (tg.in(this->inputs[0])) write_masked(g, tg.dcot_slot(this->inputs[0], g.tokens() * width(g)), dgout);
    first_rows_sum(g, tg.dgrad[static_cast<size_t>(param())], dgout);
  }

 private:
  int param() const { return this->params[0]; }
  index_t width(const Graph<T>& g) const { return g.width(this->output); }
  std::vector<std::int64_t> rows_;  // per token: 0 for a sample's first (c's one row), else -1

  // The slot gets `rows` with every sample's first row zero (it does not reach the output).
  void write_masked(const Graph<T>& g, const Slot<T>& slot, const T* rows) const {
    const index_t d = width(g), L = g.tokens_per_sample();
    g.backend().run(rows::ClassTokenRows<T>{nullptr, rows, slot.data, slot.add, L * d, d}, g.tokens() * d);
  }

  // out (1, d) = the sum over samples of rows' first row: the first d columns' sums of the
  // (samples, L d) rows.
  void first_rows_sum(const Graph<T>& g, T* out, const T* rows) const {
    if (!out) return;
    const index_t d = width(g), L = g.tokens_per_sample();
    g.backend().run(rows::ColumnSums<T>{rows, nullptr, out, g.samples(), L * d, false}, d);
  }
};

}  // namespace blockhess::engine
