// A residual connection: out = a + b. Linear, no parameters, no curvature; a parameter reaching
// both inputs has the sum of its two factors at the output.
#pragma once

#include <string>

#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::engine {

template <class T>
class ResidualNode final : public Node<T> {
 public:
  explicit ResidualNode(const char* stage) : stage_(stage) {}

  void forward(Graph<T>& g) override {
    const index_t size = g.tokens() * g.width(this->output);
    const T *a = g.value(this->inputs[0]), *b = g.value(this->inputs[1]);
    T* out = g.value_out(this->output);
    g.backend().run(rows::SumEntries<T>{a, b, out}, size);
    require_finite(g.backend(), out, size, stage_);
  }

  void vjp(Graph<T>& g) const override {
    const index_t size = g.tokens() * g.width(this->output);
    for (int v : this->inputs)
      if (g.varies(v)) write_slot(g, g.cotangent_slot(v), g.cotangent(this->output), size);
  }

  void push(Graph<T>& g) const override {
    g.set_factors(this->output, add(g.backend(), g.factors(this->inputs[0]), g.factors(this->inputs[1]), g.tokens()));
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  bool token_local() const override { return true; }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T *da = tg.in(this->inputs[0]), *db = tg.in(this->inputs[1]);
    if (!da && !db) return;
    const index_t size = g.tokens() * g.width(this->output);
    T* out = tg.out(this->output, size);
    if (da && db) g.backend().run(rows::SumEntries<T>{da, db, out}, size);
    else g.copy(da ? da : db, out, size);
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {
    const index_t size = g.tokens() * g.width(this->output);
    for (int v : this->inputs)
      if (tg.in(v)) write_slot(g, tg.dcot_slot(v, size), tg.dcot[this->output].data(), size);
  }

 private:
  const char* stage_;
};

}  // namespace blockhess::engine
