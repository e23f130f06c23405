// A pointwise activation, entry by entry: out = phi(in) (activation.hpp: relu, gelu, gelu_tanh,
// silu). Its Jacobian is diag(phi'(in_t)) per token; a smooth phi adds the site
// Omega_t = diag(g_t * phi''(in_t)) at its input (relu has phi'' = 0 almost everywhere: none).
#pragma once

#include "blockhess/activation.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/pointwise.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::engine {

template <class T>
class PointwiseNode final : public Node<T> {
 public:
  explicit PointwiseNode(activation::Kind kind) : kind_(kind) {}

  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), w = g.width(this->output), size = n * w;
    T* y = g.value_out(this->output);
    first_.resize(g.backend(), size);
    // phi'' = 0 for relu: second_ stays empty (only a smooth phi reads it).
    if (activation::is_piecewise_linear(kind_)) second_.clear();
    else second_.resize(g.backend(), size);
    g.backend().run(rows::ActivationForward<T>{kind_, g.value(in()), y, first_.data(), second_.empty() ? nullptr : second_.data()},
                    size);
    require_finite(g.backend(), y, size, "block: the activation of the FFN's hidden units");
  }

  void vjp(Graph<T>& g) const override {
    if (!g.varies(in())) return;
    scaled(g, first_.data(), g.cotangent(this->output), g.cotangent_slot(in()), g.tokens() * g.width(in()));
  }

  void push(Graph<T>& g) const override {
    g.set_factors(this->output, scale_rows(g.backend(), g.factors(in()), g.tokens(), first_.data()));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    if (activation::is_piecewise_linear(kind_) || !g.varies(in())) return;
    const index_t size = g.tokens() * g.width(in());
    auto omega = std::make_shared<Buffer<T>>(static_cast<size_t>(size));
    const T* gout = g.cotangent(this->output);
    for (index_t k = 0; k < size; ++k) (*omega)[k] = gout[k] * second_[k];
    terms.sites.push_back(Site<T>{in(), std::move(omega), /*diagonal=*/true});
  }

  // forward: phi' (and phi'' for a smooth phi); curvature: its diagonal site.
  Footprint footprint(const Graph<T>& g) const override {
    const index_t size = g.tokens() * g.width(this->output);
    const bool smooth = !activation::is_piecewise_linear(kind_);
    return {smooth ? 2 * size : size, 0, 0, smooth ? size : 0};
  }

  bool token_local() const override { return true; }
  bool pulls_sites() const override { return true; }
  void pull_site(const Graph<T>& g, index_t t, const T* omega_out, T* omega_in) const override {
    const index_t w = g.width(in());
    const T* m = first_.data() + t * w;
    for (index_t a = 0; a < w; ++a)
      for (index_t b = 0; b < w; ++b) omega_in[a * w + b] = m[a] * omega_out[a * w + b] * m[b];
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(in());
    if (!din) return;
    const index_t size = g.tokens() * g.width(in());
    scaled(g, first_.data(), din, Slot<T>{tg.out(this->output, size), false}, size);
  }

  // d(phi' g) = phi' dg + (curved) phi'' g d in.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const T* din = tg.in(in());
    if (!din) return;
    const index_t size = g.tokens() * g.width(in());
    const Slot<T> slot = tg.dcot_slot(in(), size);
    const bool smooth = curved && !activation::is_piecewise_linear(kind_);
    g.backend().run(rows::ActivationCotangentTangent<T>{first_.data(), smooth ? second_.data() : nullptr,
                                                        tg.dcot[this->output].data(), g.cotangent(this->output), din,
                                                        slot.data, slot.add},
                    size);
  }

 private:
  int in() const { return this->inputs[0]; }
  static void scaled(const Graph<T>& g, const T* scale, const T* x, const Slot<T>& slot, index_t size) {
    g.backend().run(rows::ScaleEntries<T>{scale, x, slot.data, slot.add}, size);
  }

  activation::Kind kind_;
  BackendBuffer<T> first_, second_;  // phi'(in), phi''(in) (written whole by forward; second_ empty for relu)
};

}  // namespace blockhess::engine
