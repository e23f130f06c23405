// LayerNorm without affine parameters, row by row: y_t = (u_t - mean(u_t)) / sigma_t
// (docs/derivation.md §3.1). Its row functions (layernorm.hpp) are also the public
// layernorm_* functions'. Its Jacobian J_t is symmetric, so the jvp and the vjp are one function.
#pragma once

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::engine {

template <class T>
class LayerNormNode final : public Node<T> {
 public:
  explicit LayerNormNode(T eps) : eps_(eps) {}

  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), d = g.width(this->output);
    sigma_.resize(static_cast<size_t>(n));
    layernorm::normalize(g.value(in()), n, d, eps_, g.value_out(this->output), sigma_.data());
  }

  void vjp(Graph<T>& g) const override {
    if (!g.varies(in())) return;
    const index_t n = g.tokens(), d = width(g);
    const T *y = g.value(this->output), *gy = g.cotangent(this->output);
    const Slot<T> slot = g.cotangent_slot(in());
    blockhess::detail::parallel_for(n, 4 * d, [&](index_t t) {
      if (!slot.add) return layernorm::vjp_row(y + t * d, sigma_[t], gy + t * d, d, slot.data + t * d);
      Buffer<T> u(static_cast<size_t>(d));
      layernorm::vjp_row(y + t * d, sigma_[t], gy + t * d, d, u.data());
      for (index_t a = 0; a < d; ++a) slot.data[t * d + a] += u[a];
    });
  }

  void push(Graph<T>& g) const override {
    g.set_factors(this->output, left_multiply(g.factors(in()), g.tokens(), width(g), [&](index_t t) { return jacobian(g, t); }));
  }

  // The site at its input: Omega_t = sum_a g_a d2 y_a / du_t^2 (the row's second derivative
  // contracted with its output's cotangent).
  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    if (!g.varies(in())) return;
    const index_t n = g.tokens(), d = width(g);
    auto omega = std::make_shared<Buffer<T>>(static_cast<size_t>(n * d * d));
    const T *y = g.value(this->output), *gy = g.cotangent(this->output);
    blockhess::detail::parallel_for(n, d * d, [&](index_t t) {
      layernorm::hessian_contract_row(y + t * d, sigma_[t], static_cast<const T*>(nullptr), gy + t * d, d,
                                      omega->data() + t * d * d);
    });
    terms.sites.push_back(Site<T>{in(), std::move(omega)});
  }

  bool pulls_sites() const override { return true; }
  void pull_site(const Graph<T>& g, index_t t, const T* omega_out, T* omega_in) const override {
    const index_t d = width(g);
    const Mat<T> J = jacobian(g, t);
    MapM<T>(omega_in, d, d).noalias() = J.transpose() * MapC<T>(omega_out, d, d) * J;
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* du = tg.in(in());
    if (!du) return;
    const index_t n = g.tokens(), d = width(g);
    const T* y = g.value(this->output);
    T* dy = tg.out(this->output, n * d);
    for (index_t t = 0; t < n; ++t) layernorm::vjp_row(y + t * d, sigma_[t], du + t * d, d, dy + t * d);
  }

  // d(J^T g) = J^T dg + (curved) dJ^T g, the second with layernorm::vjp_tangent_row in O(d) a row.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    if (!tg.in(in())) return;
    const index_t n = g.tokens(), d = width(g);
    const T *y = g.value(this->output), *gy = g.cotangent(this->output), *dgy = tg.dcot[this->output].data();
    const T *du = tg.in(in()), *dy = tg.in(this->output);
    Buffer<T>& rows = tg.scratch(this->index, 0, 3 * d);
    const Slot<T> slot = tg.dcot_slot(in(), n * d);
    T *u = rows.data(), *term = rows.data() + d, *du_t = rows.data() + 2 * d;
    for (index_t t = 0; t < n; ++t) {
      layernorm::vjp_row(y + t * d, sigma_[t], dgy + t * d, d, term);
      if (curved) {
        layernorm::vjp_row(y + t * d, sigma_[t], gy + t * d, d, u);  // this node's own J^T g
        layernorm::vjp_tangent_row(y + t * d, sigma_[t], gy + t * d, u, du + t * d, dy + t * d, d, du_t);
        for (index_t a = 0; a < d; ++a) term[a] += du_t[a];
      }
      T* o = slot.data + t * d;
      for (index_t a = 0; a < d; ++a) o[a] = slot.add ? o[a] + term[a] : term[a];
    }
  }

  const Buffer<T>& sigma() const { return sigma_; }

 private:
  int in() const { return this->inputs[0]; }
  index_t width(const Graph<T>& g) const { return g.width(this->output); }
  Mat<T> jacobian(const Graph<T>& g, index_t t) const {
    const index_t d = width(g);
    Mat<T> J(d, d);
    layernorm::jacobian_row(g.value(this->output) + t * d, sigma_[t], static_cast<const T*>(nullptr), d, J.data());
    return J;
  }

  T eps_;
  Buffer<T> sigma_;
};

}  // namespace blockhess::engine
