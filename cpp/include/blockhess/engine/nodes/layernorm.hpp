// A row norm: LayerNorm, n_t = (u_t - mean(u_t)) / sigma_t (docs/derivation.md §3.1), or RMSNorm,
// n_t = u_t / r_t (rmsnorm.hpp), then y_t = gamma * n_t + beta, with gamma and beta (1, d)
// parameters when the node owns them (RMSNorm: gamma only), or the constants 1 and 0. The row
// functions (layernorm.hpp) are also the public layernorm_* functions'. For either norm:
//   Jacobian J_t = diag(gamma) J0_t, J0_t the symmetric Jacobian of n_t;
//   gamma enters with vec_t = [1], U_t = diag(n_t); beta with vec_t = [1], U_t = I;
//   curvature: the site sum_a g_a gamma_a d2 n_a / du_t^2 at its input, and (affine) the bilinear
//   <g, dn dgamma> between the input and gamma.
#pragma once

#include <memory>
#include <vector>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/norm.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/rmsnorm.hpp"

namespace blockhess::engine {

// The row math of each norm, behind one interface (the per-row scale is sigma or r).
struct LayerNormRows {
  static constexpr bool rms = false;  // the row operations' flag (engine/rows/norm.hpp)
  template <class T> static void check(const T* sigma, index_t n) { layernorm::detail::check_sigmas(sigma, n); }
  template <class... A> static void jacobian_row(A... a) { layernorm::jacobian_row(a...); }
  template <class... A> static void hessian_contract_row(A... a) { layernorm::hessian_contract_row(a...); }
};
struct RmsNormRows {
  static constexpr bool rms = true;
  template <class T> static void check(const T* r, index_t n) { rmsnorm::detail::check_scales(r, n); }
  template <class... A> static void jacobian_row(A... a) { rmsnorm::jacobian_row(a...); }
  template <class... A> static void hessian_contract_row(A... a) { rmsnorm::hessian_contract_row(a...); }
};

template <class T, class Rows>
class NormNode final : public Node<T> {
 public:
  explicit NormNode(T eps) : eps_(eps) {}

  void forward(Graph<T>& g) override {
    const index_t n = g.tokens(), d = g.width(this->output);
    sigma_.resize(g.backend(), n);
    T* y = g.value_out(this->output);
    if (affine()) normalized_.resize(g.backend(), n * d);
    g.backend().run(rows::NormalizeRows<T>{g.value(in()), affine() ? normalized_.data() : y, sigma_.data(), d, eps_, Rows::rms},
                    n);
    Rows::check(HostView<T, T>(g.backend(), sigma_.data(), n).data(), n);
    if (!affine()) return;
    g.backend().run(rows::ScaleColumns<T>{normalized_.data(), g.weight(gamma_param()), y, d}, n * d);
    if (has_beta()) g.backend().run(rows::AddBias<T>{g.weight(beta_param()), y, d}, n * d);
    require_finite(g.backend(), y, n * d, "block: a LayerNorm's output gamma * n + beta");
  }

  void vjp(Graph<T>& g) const override {
    const index_t n = g.tokens(), d = width(g);
    const T* gy = g.cotangent(this->output);
    if (g.varies(in())) {
      const Slot<T> slot = g.cotangent_slot(in());
      g.backend().run(rows::NormVjpRows<T>{n_t(g, 0), sigma_.data(), gy, gamma_or_null(g), slot.data, slot.add, d, Rows::rms},
                      n);
    }
    if (!affine()) return;
    if (T* grad = g.gradient_out(gamma_param())) token_sums(g, gy, d, grad, normalized_.data());
    if (has_beta())
      if (T* grad = g.gradient_out(beta_param())) token_sums(g, gy, d, grad);
  }

  void push(Graph<T>& g) const override {
    const index_t n = g.tokens(), d = width(g);
    const Backend<T>& backend = g.backend();
    g.set_factors(this->output, left_multiply_jacobians(backend, g.factors(in()), n, d, [&](index_t t0, index_t count, T* J) {
      backend.run(rows::NormJacobianRows<T>{n_t(g, t0), sigma_.data() + t0, gamma_or_null(g), J, d, Rows::rms}, count);
    }));
    if (!affine()) return;
    const SharedArray<T> ones = filled(backend, n, T(1));
    if (g.selected(gamma_param())) {  // vec [1], G_t = diag(n_t)
      BackendBuffer<T> normalized(backend, n * d);
      g.copy(normalized_.data(), normalized.data(), n * d);
      const Factor<T> entered = entering<T>(kron::Split{1, d, true}, ones, d);
      g.set_factor(this->output, g.whole(gamma_param()), moved(entered, Form::diagonal, d, std::move(normalized)));
    }
    if (has_beta() && g.selected(beta_param()))
      g.set_factor(this->output, g.whole(beta_param()), entering<T>(kron::Split{1, d, true}, ones, d));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    if (!g.varies(in())) return;
    const index_t n = g.tokens(), d = width(g);
    const T* gy = g.cotangent(this->output);
    auto omega = std::make_shared<Buffer<T>>(static_cast<size_t>(n * d * d));
    const T* gam = affine() ? g.weight(gamma_param()) : nullptr;
    blockhess::detail::parallel_for(n, d * d, [&](index_t t) {
      Rows::hessian_contract_row(n_t(g, t), sigma_[t], gam, gy + t * d, d, omega->data() + t * d * d);
    });
    terms.sites.push_back(Site<T>{in(), std::move(omega)});
    if (!affine() || !g.selected(gamma_param())) return;
    // <g, dn dgamma>: sum_t sum_a g_ta (J0_t du_t)_a dgamma_a, with gamma's vec [1].
    const T* ones = terms.kept(Buffer<T>(n, T(1)));
    for (int p = 0; p < g.num_pieces(); ++p) {
      const Factor<T>& f = g.factor(in(), p);
      if (!f.present) continue;
      terms.kron.push_back(KronTerm<T>{p, g.whole(gamma_param()), f.split, kron::Split{1, d, true}, f.vec->data(), ones,
                                       [this, &g, f, gy, d](index_t t, T* out) {
                                         Mat<T> U;
                                         f.materialise(t, U);
                                         const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> g_t(gy + t * d, d);
                                         MapM<T>(out, f.n_mat(), d).noalias() =
                                             (g_t.asDiagonal() * (jacobian(g, t, false) * U)).transpose();
                                       },
                                       false});
    }
  }

  // forward: sigma and the normalised rows; a product: their tangent and five rows a thread;
  // curvature: a (d, d) Omega a token.
  Footprint footprint(const Graph<T>& g) const override {
    const index_t n = g.tokens(), d = width(g), rows = 5 * d * parallel::num_threads();
    return {n * (1 + d), 2 * d * parallel::num_threads(), n * d + rows, n * (1 + d * d)};
  }
  // push(): the Jacobians it maps the factors with, a chunk of tokens at a time, the chunk no larger
  // than the narrowest factor's result (factor.hpp's left_multiply_jacobians).
  index_t push_scratch(const Graph<T>& g, index_t r) const override {
    return g.tokens() * width(g) * std::min(width(g), r);
  }
  bool token_local() const override { return true; }
  bool pulls_sites() const override { return !affine(); }
  bool parameters_move_alike() const override { return false; }  // gamma's factor is diagonal, beta's the identity
  void pull_site(const Graph<T>& g, index_t t, const T* omega_out, T* omega_in) const override {
    const index_t d = width(g);
    const Mat<T> J = jacobian(g, t, true);
    MapM<T>(omega_in, d, d).noalias() = J.transpose() * MapC<T>(omega_out, d, d) * J;
  }

  // dy = gamma * J0 du + n * dgamma + dbeta.
  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* du = tg.in(in());
    const T *dgamma = affine() ? tg.dW[gamma_param()] : nullptr, *dbeta = has_beta() ? tg.dW[beta_param()] : nullptr;
    if (!du && !dgamma && !dbeta) return;
    const index_t n = g.tokens(), d = width(g);
    T* dy = tg.out(this->output, n * d);
    T* dn = affine() && du ? tg.scratch(this->index, kNormalizedTangent, n * d).data() : dy;
    g.backend().run(rows::NormTangentRows<T>{n_t(g, 0), sigma_.data(), du, gamma_or_null(g), dgamma, dbeta, dn, dy, d,
                                             Rows::rms},
                    n);
  }

  // With g^ = gamma * g the cotangent of n: d(J0^T g^) = J0^T dg^ + (curved) dJ0^T g^ (in O(d) a row,
  // layernorm::vjp_tangent_row), dg^ = gamma * dg + (curved) dgamma * g; the gradients of gamma
  // and beta, sum_t n_t * g_t and sum_t g_t, by the product rule.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t n = g.tokens(), d = width(g);
    const T *gy = g.cotangent(this->output), *dgy = tg.dcot[this->output].data();
    const T *du = tg.in(in()), *dgamma = affine() ? tg.dW[gamma_param()] : nullptr;
    const T* dn = !du ? nullptr : affine() ? tg.scratch(this->index, kNormalizedTangent, n * d).data() : tg.in(this->output);
    if (du) {
      const Slot<T> slot = tg.dcot_slot(in(), n * d);
      g.backend().run(rows::NormCotangentTangentRows<T>{n_t(g, 0), sigma_.data(), gy, dgy, gamma_or_null(g), dgamma, du, dn,
                                                        slot.data, slot.add, curved, d, Rows::rms},
                      n);
    }
    if (!affine()) return;
    if (T* out = tg.dgrad[gamma_param()]) {
      token_sums(g, dgy, d, out, normalized_.data());
      if (curved && dn) token_sums(g, gy, d, out, dn, true);
    }
    if (has_beta())
      if (T* out = tg.dgrad[beta_param()]) token_sums(g, dgy, d, out);
  }

 private:
  enum : int { kNormalizedTangent };

  bool affine() const { return !this->params.empty(); }  // gamma, and beta unless RMSNorm
  bool has_beta() const { return this->params.size() == 2; }
  int in() const { return this->inputs[0]; }
  int gamma_param() const { return this->params[0]; }
  int beta_param() const { return this->params[1]; }
  index_t width(const Graph<T>& g) const { return g.width(this->output); }
  // The normalized row n_t (the output itself without affine parameters).
  const T* n_t(const Graph<T>& g, index_t t) const {
    return (affine() ? normalized_.data() : g.value(this->output)) + t * width(g);
  }
  const T* gamma_or_null(const Graph<T>& g) const { return affine() ? g.weight(gamma_param()) : nullptr; }
  // J_t = diag(gamma) J0_t (with_gamma), or J0_t.
  Mat<T> jacobian(const Graph<T>& g, index_t t, bool with_gamma) const {
    const index_t d = width(g);
    Mat<T> J(d, d);
    const T* gam = with_gamma && affine() ? g.weight(gamma_param()) : nullptr;
    Rows::jacobian_row(n_t(g, t), sigma_[t], gam, d, J.data());
    return J;
  }

  T eps_;
  BackendBuffer<T> sigma_;
  BackendBuffer<T> normalized_;  // n (only with affine parameters; otherwise the output is n)
};

template <class T>
using LayerNormNode = NormNode<T, LayerNormRows>;
template <class T>
using RmsNormNode = NormNode<T, RmsNormRows>;

}  // namespace blockhess::engine
