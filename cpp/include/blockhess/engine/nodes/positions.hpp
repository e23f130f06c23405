// Learned positions: out_t = in_t + W_P[t mod L], row i of W_P (positions, d) for the token at
// position i of its sample (GPT-2's wpe after its token embedding, a ViT's after its patch
// embedding). Linear, its only curvature none: the input's cotangent passes through, W_P's
// gradient is the cotangent's rows scattered onto their positions' rows, and a tangent adds the
// positions' rows of dW_P. A factor at the input passes through unchanged.
//
// W_P moves every token's input to the first block's attention, which mixes tokens, each token
// by another row: the per-token factors do not reach it, and push() says so (FactorsDoNotReach:
// its dense Hessian and diagonal come from Hessian-vector products, loss.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"

namespace blockhess::engine {

template <class T>
class PositionsNode final : public Node<T> {
 public:
  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), d = width(g), L = g.tokens_per_sample();
    positions_.resize(static_cast<size_t>(n));
    for (index_t t = 0; t < n; ++t) positions_[static_cast<size_t>(t)] = t % L;
    T* out = g.value_out(this->output);
    g.copy(g.value(this->inputs[0]), out, n * d);
    // W_P's first L rows, one (L d) bias a sample.
    g.backend().run(rows::AddBias<T>{g.weight(param()), out, L * d}, n * d);
  }

  void vjp(Graph<T>& g) const override {
    const index_t size = g.tokens() * width(g);
    const T* gout = g.cotangent(this->output);
    if (g.varies(this->inputs[0])) write_slot(g, g.cotangent_slot(this->inputs[0]), gout, size);
    scatter(g, g.gradient_out(param()), gout);
  }

  void push(Graph<T>& g) const override {
    if (g.selected(param()))
      throw FactorsDoNotReach("engine: " + g.parameter(param()).name + " moves every token's input to the attention, "
                              "which mixes tokens: the per-token factors do not reach it");
    std::vector<Factor<T>> same;
    for (const Factor<T>* f : g.factors(this->inputs[0])) same.push_back(*f);
    g.set_factors(this->output, std::move(same));
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  // W_P's rows looked up by the tokens' positions (LinearUse), which forward() keeps.
  LinearUse<T> linear_use(const Graph<T>& g, int) const override {
    return {nullptr, g.cotangent(this->output), positions_.data()};
  }
  Footprint footprint(const Graph<T>& g) const override { return {g.tokens(), 0, 0, 0}; }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(this->inputs[0]);
    const T* dP = tg.dW[static_cast<size_t>(param())];
    if (!din && !dP) return;
    const index_t n = g.tokens(), d = width(g), L = g.tokens_per_sample();
    T* out = tg.out(this->output, n * d);
    if (din) g.copy(din, out, n * d);
    else g.backend().run(rows::Zero<T>{out}, n * d);
    if (dP) g.backend().run(rows::AddBias<T>{dP, out, L * d}, n * d);
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    const index_t size = g.tokens() * width(g);
    const T* dgout = tg.dcot[static_cast<size_t>(this->output)].data();
    if (tg.in(this->inputs[0])) write_slot(g, tg.dcot_slot(this->inputs[0], size), dgout, size);
    scatter(g, tg.dgrad[static_cast<size_t>(param())], dgout);
  }

 private:
  int param() const { return this->params[0]; }
  index_t width(const Graph<T>& g) const { return g.width(this->output); }
  std::vector<std::int64_t> positions_;  // each token's position in its sample

  // out (W_P's shape) = each token's row of `rows` summed onto its position's row, sample after
  // sample (the column sums of the (samples, L d) rows); rows past L stay 0.
  void scatter(const Graph<T>& g, T* out, const T* rows) const {
    if (!out) return;
    const index_t d = width(g), L = g.tokens_per_sample();
    g.backend().run(rows::ColumnSums<T>{rows, nullptr, out, g.samples(), L * d, false}, L * d);
    g.backend().run(rows::Zero<T>{out + L * d}, g.parameter(param()).size() - L * d);
  }
};

}  // namespace blockhess::engine
