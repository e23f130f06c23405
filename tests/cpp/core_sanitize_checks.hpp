// The checks of core_sanitize (see core_sanitize.cpp): templates over the scalar type, compiled in
// one translation unit per type (core_sanitize_double.cpp, core_sanitize_float.cpp) so that the two
// halves of the sanitizer build run in parallel.
#pragma once

#include <blockhess/block_model.hpp>
#include <blockhess/commutation.hpp>
#include <blockhess/components.hpp>
#include <blockhess/kron_sum.hpp>
#include <blockhess/layernorm.hpp>
#include <blockhess/parallel.hpp>
#include <blockhess/softmax.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core_sanitize.hpp"

namespace sanitize {

using blockhess::index_t;
namespace bh = blockhess;

inline void report(bool ok, const char* file, int line, const char* what, const std::string& context) {
  ++g_checks;
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "FAIL %s:%d: %s [%s]\n", file, line, what, context.c_str());
}
#define CHECK(cond, ctx) report(static_cast<bool>(cond), __FILE__, __LINE__, #cond, ctx)

template <class T>
const char* type_name() {
  return std::is_same_v<T, double> ? "double" : "float";
}

inline std::string shape(std::initializer_list<index_t> dims) {
  std::string s = "(";
  for (index_t v : dims) s += (s.size() > 1 ? "," : "") + std::to_string(v);
  return s + ")";
}

template <class T>
std::vector<T> randn(std::mt19937_64& rng, index_t n, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<T> v(static_cast<size_t>(n));
  for (T& x : v) x = static_cast<T>(dist(rng));
  return v;
}

template <class T>
bool all_finite(const std::vector<T>& v) {
  return std::all_of(v.begin(), v.end(), [](T x) { return std::isfinite(x); });
}

template <class T>
double max_abs(const std::vector<T>& v) {
  double m = 0;
  for (T x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

// max |a - b| / max(max |b|, floor).
template <class T>
double rel_diff(const std::vector<T>& a, const std::vector<T>& b, double floor = 1e-300) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0;
  for (size_t k = 0; k < a.size(); ++k) num = std::max(num, std::abs(static_cast<double>(a[k]) - b[k]));
  return num / std::max(max_abs(b), floor);
}

// Loose tolerance of the "same quantity, different order of operations" comparisons.
template <class T>
double tol() {
  return std::is_same_v<T, double> ? 1e-11 : 2e-4;
}

// Expects fn() to throw E.
template <class E, class Fn>
bool throws(Fn&& fn) {
  try {
    fn();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

// Runs fn at 1 and at 3 threads (3 > the CI's 2 cores: the pool must cope with descheduled workers).
template <class Fn>
void with_thread_counts(Fn&& fn) {
  for (int threads : {1, 3}) {
    bh::parallel::set_num_threads(threads);
    fn(threads);
  }
  bh::parallel::set_num_threads(2);
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

template <class T>
void check_layernorm(std::mt19937_64& rng, index_t L, index_t d, T eps, bool with_gamma) {
  namespace ln = bh::layernorm;
  const std::string ctx = std::string("layernorm ") + type_name<T>() + " " + shape({L, d}) +
                          " eps=" + std::to_string(static_cast<double>(eps)) + (with_gamma ? " gamma" : "");
  const auto X = randn<T>(rng, L * d);
  const auto gv = randn<T>(rng, d), bv = randn<T>(rng, d);
  const T* gamma = with_gamma ? gv.data() : nullptr;
  const T* beta = with_gamma ? bv.data() : nullptr;
  std::vector<T> Z(L * d), sigma(L), y(L * d);
  if (d == 1 && eps == T(0)) {  // a one-feature row is constant: LayerNorm is not differentiable there
    CHECK(throws<std::domain_error>([&] { ln::forward(X.data(), L, d, eps, gamma, beta, Z.data(), sigma.data()); }),
          ctx);
    return;
  }
  ln::forward(X.data(), L, d, eps, gamma, beta, Z.data(), sigma.data());
  ln::normalize(X.data(), L, d, eps, y.data(), sigma.data());
  CHECK(all_finite(Z) && all_finite(y) && all_finite(sigma), ctx);
  for (index_t i = 0; i < L; ++i) {
    double mean = 0;
    for (index_t a = 0; a < d; ++a) mean += y[i * d + a];
    CHECK(std::abs(mean / d) < 50 * tol<T>(), ctx + " row mean of y");
  }

  std::vector<T> J(L * d * d), Jd(L * d * L * d), H(L * d * d * d), C(L * d * d);
  ln::jacobian_blocks(y.data(), sigma.data(), gamma, L, d, J.data());
  ln::jacobian_dense(y.data(), sigma.data(), gamma, L, d, Jd.data());
  ln::hessian_blocks(y.data(), sigma.data(), gamma, L, d, H.data());
  CHECK(all_finite(J) && all_finite(H), ctx);
  const index_t n = L * d;
  bool dense_ok = true, sym_ok = true;
  for (index_t o = 0; o < n; ++o)
    for (index_t p = 0; p < n; ++p) {
      const index_t i = o / d, a = o % d, u = p / d, b = p % d;
      const T want = i == u ? J[(i * d + a) * d + b] : T(0);
      dense_ok &= Jd[o * n + p] == want;
    }
  for (index_t i = 0; i < L; ++i)
    for (index_t a = 0; a < d; ++a)
      for (index_t b = 0; b < d; ++b)
        for (index_t c = 0; c < d; ++c)
          sym_ok &= H[((i * d + a) * d + b) * d + c] == H[((i * d + a) * d + c) * d + b];
  CHECK(dense_ok, ctx + " dense Jacobian = blocks");
  CHECK(sym_ok, ctx + " Hessian blocks symmetric");

  // Contraction with a cotangent G equals the explicit sum over the blocks.
  const auto G = randn<T>(rng, L * d);
  ln::hessian_contract(y.data(), sigma.data(), gamma, G.data(), L, d, C.data());
  std::vector<T> Cref(L * d * d, T(0));
  for (index_t i = 0; i < L; ++i)
    for (index_t a = 0; a < d; ++a)
      for (index_t bc = 0; bc < d * d; ++bc) Cref[i * d * d + bc] += G[i * d + a] * H[(i * d + a) * d * d + bc];
  CHECK(rel_diff(C, Cref) < 100 * tol<T>(), ctx + " hessian_contract");

  if (n <= 30) {  // the dense second derivative is (L d)^3
    std::vector<T> Hd(n * n * n), scratch(d * d * d);
    ln::hessian_dense(y.data(), sigma.data(), gamma, L, d, Hd.data(), scratch.data());
    bool ok = true;
    for (index_t i = 0; i < L; ++i)
      for (index_t a = 0; a < d; ++a)
        for (index_t b = 0; b < d; ++b)
          for (index_t c = 0; c < d; ++c)
            ok &= Hd[((i * d + a) * n + i * d + b) * n + i * d + c] == H[((i * d + a) * d + b) * d + c];
    CHECK(ok, ctx + " dense Hessian = blocks");
  }
  std::vector<T> Jg(L * d * d), Jb(L * d * d);
  ln::jacobian_gamma(y.data(), L, d, Jg.data());
  ln::jacobian_beta(L, d, Jb.data());
  CHECK(all_finite(Jg) && all_finite(Jb), ctx);

  if constexpr (std::is_same_v<T, double>) {  // central differences of row i = L - 1
    const index_t i = L - 1;
    const double h = 1e-6;
    double worst = 0;
    std::vector<T> Xp = X, Zp(L * d), Zm(L * d), s(L);
    for (index_t b = 0; b < d; ++b) {
      Xp[i * d + b] = X[i * d + b] + h;
      ln::forward(Xp.data(), L, d, eps, gamma, beta, Zp.data(), s.data());
      Xp[i * d + b] = X[i * d + b] - h;
      ln::forward(Xp.data(), L, d, eps, gamma, beta, Zm.data(), s.data());
      Xp[i * d + b] = X[i * d + b];
      for (index_t a = 0; a < d; ++a)
        worst = std::max(worst, std::abs((Zp[i * d + a] - Zm[i * d + a]) / (2 * h) - J[(i * d + a) * d + b]));
    }
    CHECK(worst < 1e-6 * std::max(1.0, max_abs(J)), ctx + " finite differences of the Jacobian");
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax

template <class T>
void check_softmax(std::mt19937_64& rng, index_t m, index_t n) {
  namespace sm = bh::softmax;
  const std::string ctx = std::string("softmax ") + type_name<T>() + " " + shape({m, n});
  const auto Tm = randn<T>(rng, m * n, 2.0);
  std::vector<T> A(m * n), J(m * n * n), H(m * n * n * n);
  sm::forward(Tm.data(), m, n, A.data());
  sm::jacobian_blocks(A.data(), m, n, J.data());
  sm::hessian_blocks(A.data(), m, n, H.data());
  CHECK(all_finite(A) && all_finite(J) && all_finite(H), ctx);
  bool rows_ok = true, sym_ok = true;
  for (index_t i = 0; i < m; ++i) {
    double s = 0;
    for (index_t k = 0; k < n; ++k) s += A[i * n + k];
    rows_ok &= std::abs(s - 1) < 10 * tol<T>();
    for (index_t j = 0; j < n; ++j)
      for (index_t k = 0; k < n; ++k)
        for (index_t l = 0; l < n; ++l)
          sym_ok &= H[((i * n + j) * n + k) * n + l] == H[((i * n + j) * n + l) * n + k];
  }
  CHECK(rows_ok, ctx + " rows sum to 1");
  CHECK(sym_ok, ctx + " Hessian blocks symmetric");

  const index_t N = m * n;
  std::vector<T> Jd(N * N);
  sm::jacobian_dense(A.data(), m, n, Jd.data());
  bool dense_ok = true;
  for (index_t o = 0; o < N; ++o)
    for (index_t p = 0; p < N; ++p)
      dense_ok &= Jd[o * N + p] == (o / n == p / n ? J[(o / n * n + o % n) * n + p % n] : T(0));
  CHECK(dense_ok, ctx + " dense Jacobian = blocks");
  if (N <= 30) {
    std::vector<T> Hd(N * N * N);
    sm::hessian_dense(A.data(), m, n, Hd.data());
    bool ok = true;
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < n; ++j)
        for (index_t k = 0; k < n; ++k)
          for (index_t l = 0; l < n; ++l)
            ok &= Hd[((i * n + j) * N + i * n + k) * N + i * n + l] == H[((i * n + j) * n + k) * n + l];
    CHECK(ok, ctx + " dense Hessian = blocks");
  }
  // Row helpers: contraction and vector-Jacobian product against the blocks.
  const auto g = randn<T>(rng, n);
  std::vector<T> Cm(n * n), Cref(n * n, T(0)), gt(n), gtref(n, T(0));
  sm::hessian_contract_row(A.data(), g.data(), n, Cm.data());
  sm::vjp_row(A.data(), g.data(), n, gt.data());
  for (index_t j = 0; j < n; ++j) {
    for (index_t kl = 0; kl < n * n; ++kl) Cref[kl] += g[j] * H[j * n * n + kl];
    for (index_t k = 0; k < n; ++k) gtref[k] += g[j] * J[j * n + k];
  }
  CHECK(rel_diff(Cm, Cref) < 100 * tol<T>(), ctx + " hessian_contract_row");
  CHECK(rel_diff(gt, gtref) < 100 * tol<T>(), ctx + " vjp_row");

  if constexpr (std::is_same_v<T, double>) {
    const double h = 1e-6;
    double worst = 0;
    std::vector<T> tp(Tm.begin(), Tm.begin() + n), ap(n), am(n);
    for (index_t k = 0; k < n; ++k) {
      tp[k] = Tm[k] + h;
      sm::forward_row(tp.data(), n, ap.data());
      tp[k] = Tm[k] - h;
      sm::forward_row(tp.data(), n, am.data());
      tp[k] = Tm[k];
      for (index_t j = 0; j < n; ++j) worst = std::max(worst, std::abs((ap[j] - am[j]) / (2 * h) - J[j * n + k]));
    }
    CHECK(worst < 1e-8, ctx + " finite differences of the Jacobian");
  }
  CHECK(throws<std::invalid_argument>([&] { sm::forward(Tm.data(), 0, n, A.data()); }), ctx + " m = 0");
}

// ---------------------------------------------------------------------------------------------
// Commutation and Kronecker products

template <class T>
void check_commutation(std::mt19937_64& rng, index_t m, index_t n) {
  namespace cm = bh::commutation;
  const std::string ctx = std::string("commutation ") + type_name<T>() + " " + shape({m, n});
  const index_t N = m * n, cols = 3;
  std::vector<std::int64_t> perm(N);
  cm::permutation(m, n, perm.data());
  std::vector<T> K(N * N);
  cm::dense(m, n, K.data());
  const auto v = randn<T>(rng, N * cols);
  std::vector<T> Kv(N * cols), back(N * cols), Kdense(N * cols, T(0));
  cm::apply(v.data(), m, n, cols, Kv.data());
  cm::apply(Kv.data(), n, m, cols, back.data());  // K_{n,m} K_{m,n} = I
  for (index_t r = 0; r < N; ++r)
    for (index_t c = 0; c < N; ++c)
      for (index_t j = 0; j < cols; ++j) Kdense[r * cols + j] += K[r * N + c] * v[c * cols + j];
  CHECK(back == v, ctx + " K_{n,m} K_{m,n} = I");
  CHECK(Kv == Kdense, ctx + " apply = dense K");
  bool perm_ok = true;
  for (index_t r = 0; r < N; ++r) perm_ok &= Kv[r * cols] == v[perm[r] * cols];
  CHECK(perm_ok, ctx + " permutation");

  // (A (x) B) vec_r(X) with A (p, m), B (q, n), against the explicit Kronecker product.
  const index_t p = m + 2, q = n + 1;
  const auto A = randn<T>(rng, p * m), B = randn<T>(rng, q * n), X = randn<T>(rng, m * n);
  std::vector<T> out(p * q), ref(p * q, T(0));
  cm::kron_apply(A.data(), p, m, B.data(), q, n, X.data(), out.data());
  for (index_t i = 0; i < p; ++i)
    for (index_t k = 0; k < q; ++k)
      for (index_t j = 0; j < m; ++j)
        for (index_t l = 0; l < n; ++l) ref[i * q + k] += A[i * m + j] * B[k * n + l] * X[j * n + l];
  CHECK(rel_diff(out, ref) < 100 * tol<T>(), ctx + " kron_apply");
  CHECK(throws<std::invalid_argument>([&] { cm::dense(0, n, K.data()); }), ctx + " m = 0");
}

// ---------------------------------------------------------------------------------------------
// Attention

template <class T>
void check_attention(std::mt19937_64& rng, index_t L, index_t d, index_t dk, index_t dv) {
  namespace at = bh::components;
  const std::string ctx = std::string("attention ") + type_name<T>() + " " + shape({L, d, dk, dv});
  const at::AttentionDims s{L, d, dk, dv};
  const auto X = randn<T>(rng, L * d);
  const auto WQ = randn<T>(rng, d * dk, 1.0 / std::sqrt(double(d))), WK = randn<T>(rng, d * dk, 1.0 / std::sqrt(double(d)));
  const auto WV = randn<T>(rng, d * dv, 1.0 / std::sqrt(double(d)));
  std::vector<T> F(L * dv);
  at::attention_forward(X.data(), WQ.data(), WK.data(), WV.data(), s, F.data());
  CHECK(all_finite(F), ctx);
  std::array<std::vector<T>, 4> J;
  for (at::AttentionWrt wrt : {at::AttentionWrt::W_Q, at::AttentionWrt::W_K, at::AttentionWrt::W_V, at::AttentionWrt::X}) {
    auto& Jw = J[static_cast<int>(wrt)];
    Jw.assign(L * dv * at::columns(s, wrt), T(0));
    at::attention_jacobian(X.data(), WQ.data(), WK.data(), WV.data(), s, wrt, Jw.data());
    CHECK(all_finite(Jw), ctx + " wrt " + std::to_string(static_cast<int>(wrt)));
    // Its working memory, from the graph wired for its shapes only (nothing read through null).
    CHECK(at::attention_working_memory<T>(s, wrt, 2) > at::attention_working_memory<T>(s, std::nullopt, 2),
          ctx + " a Jacobian's working memory exceeds the forward pass's");
  }
  if constexpr (std::is_same_v<T, double>) {  // central differences with respect to W_Q and to X
    const double h = 1e-6;
    std::vector<T> Fp(L * dv), Fm(L * dv);
    for (int which : {0, 3}) {
      auto Wq = WQ;
      auto Xv = X;
      std::vector<T>& var = which == 0 ? Wq : Xv;
      const index_t nvar = static_cast<index_t>(var.size());
      double worst = 0;
      for (index_t k = 0; k < nvar; ++k) {
        const T keep = var[k];
        var[k] = keep + h;
        at::attention_forward(Xv.data(), Wq.data(), WK.data(), WV.data(), s, Fp.data());
        var[k] = keep - h;
        at::attention_forward(Xv.data(), Wq.data(), WK.data(), WV.data(), s, Fm.data());
        var[k] = keep;
        for (index_t o = 0; o < L * dv; ++o)
          worst = std::max(worst, std::abs((Fp[o] - Fm[o]) / (2 * h) - J[which][o * nvar + k]));
      }
      CHECK(worst < 1e-7 * std::max(1.0, max_abs(J[which])),
            ctx + " finite differences wrt " + (which == 0 ? "W_Q" : "X"));
    }
  }
  CHECK(throws<std::invalid_argument>([&] {
          at::attention_forward(X.data(), WQ.data(), WK.data(), WV.data(), at::AttentionDims{L, d, 0, dv}, F.data());
        }),
        ctx + " d_k = 0");
}

// ---------------------------------------------------------------------------------------------
// FFN

template <class T>
void check_ffn(std::mt19937_64& rng, index_t L, index_t d, index_t f, index_t e) {
  namespace ff = bh::components;
  using Kind = ff::FfnJacobian;
  const std::string ctx = std::string("ffn ") + type_name<T>() + " " + shape({L, d, f, e});
  const ff::FfnDims s{L, d, f, e};
  const auto Y = randn<T>(rng, L * d), W1 = randn<T>(rng, d * f), W2 = randn<T>(rng, f * e);
  std::vector<T> F(L * e), J1(L * e * d * f), M(L * e * f), R(L * f), J2(L * e * f * e);
  std::vector<T> JYb(L * e * d), JYd(L * e * L * d), Cb(L * d * f), Cd(L * e * d * f * f * e);
  ff::ffn_forward(Y.data(), W1.data(), W2.data(), s, F.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::W_1, J1.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::W_1_factor, M.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::W_2_factor, R.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::W_2, J2.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::Y_blocks, JYb.data());
  ff::ffn_jacobian(Y.data(), W1.data(), W2.data(), s, Kind::Y, JYd.data());
  ff::ffn_cross_hessian(Y.data(), W1.data(), W2.data(), s, ff::FfnCross::blocks, Cb.data());
  ff::ffn_cross_hessian(Y.data(), W1.data(), W2.data(), s, ff::FfnCross::dense, Cd.data());
  CHECK(all_finite(F) && all_finite(J1) && all_finite(J2) && all_finite(JYd) && all_finite(Cd), ctx);
  // The working memory, from the graph wired for its shapes only: for dF/dY a tangent per thread,
  // at most one per input feature.
  const index_t forward = ff::ffn_working_memory<T>(s, std::nullopt, 1);
  CHECK((d < 2 || ff::ffn_working_memory<T>(s, Kind::Y_blocks, 2) > ff::ffn_working_memory<T>(s, Kind::Y_blocks, 1)) &&
            ff::ffn_working_memory<T>(s, Kind::W_1, 1) > forward &&
            ff::ffn_cross_working_memory<T>(s, ff::FfnCross::dense, 1) > forward,
        ctx + " working memory");

  bool kron_ok = true, y_ok = true, cross_ok = true, w2_ok = true;
  for (index_t t = 0; t < L; ++t)
    for (index_t c = 0; c < e; ++c) {
      for (index_t b = 0; b < d; ++b)
        for (index_t g = 0; g < f; ++g)
          kron_ok &= std::abs(J1[(t * e + c) * d * f + b * f + g] - Y[t * d + b] * M[(t * e + c) * f + g]) <=
                     tol<T>() * (1 + std::abs(J1[(t * e + c) * d * f + b * f + g]));
      for (index_t u = 0; u < L; ++u)
        for (index_t b = 0; b < d; ++b)
          y_ok &= JYd[(t * e + c) * L * d + u * d + b] == (u == t ? JYb[(t * e + c) * d + b] : T(0));
      for (index_t g = 0; g < f; ++g)
        for (index_t c2 = 0; c2 < e; ++c2)
          w2_ok &= J2[(t * e + c) * f * e + g * e + c2] == (c2 == c ? R[t * f + g] : T(0));
      for (index_t b = 0; b < d; ++b)
        for (index_t g = 0; g < f; ++g)
          cross_ok &= Cd[((t * e + c) * d * f + b * f + g) * f * e + g * e + c] == Cb[(t * d + b) * f + g];
    }
  CHECK(kron_ok, ctx + " W_1 Jacobian = Kronecker factors");
  CHECK(y_ok, ctx + " dense Y Jacobian = blocks");
  CHECK(w2_ok, ctx + " W_2 Jacobian = relu(H) (x) I");
  CHECK(cross_ok, ctx + " dense cross Hessian = blocks");

  if constexpr (std::is_same_v<T, double>) {  // central differences with respect to W_1
    const double h = 1e-7;
    auto W = W1;
    std::vector<T> Fp(L * e), Fm(L * e);
    double worst = 0;
    for (index_t k = 0; k < d * f; ++k) {
      const T keep = W[k];
      W[k] = keep + h;
      ff::ffn_forward(Y.data(), W.data(), W2.data(), s, Fp.data());
      W[k] = keep - h;
      ff::ffn_forward(Y.data(), W.data(), W2.data(), s, Fm.data());
      W[k] = keep;
      for (index_t o = 0; o < L * e; ++o)
        worst = std::max(worst, std::abs((Fp[o] - Fm[o]) / (2 * h) - J1[o * d * f + k]));
    }
    // A pre-activation within h of the ReLU kink would spoil a difference; random data stays clear.
    CHECK(worst < 1e-6 * std::max(1.0, max_abs(J1)), ctx + " finite differences wrt W_1");
  }
}

// ---------------------------------------------------------------------------------------------
// The whole block: loss value, gradient, Hessian (kron_sum's assembly), Jacobians

// The losses by their codes in the registry (heads.hpp).
enum Loss : int { mse = 0, cross_entropy = 1, pooled_cross_entropy = bh::heads::kPooledCrossEntropy };

template <class T>
struct BlockCase {
  bh::block::Dims D;
  index_t B;
  Loss kind;
  T eps;
};

// The paper's block (the default spec) at one batch: its parameters in the registry's order
// (params.hpp: W_Q, W_K, W_V, W_1, W_2).
template <class T>
struct BlockData {
  std::vector<bh::block::ParamShape> shapes;
  std::vector<T> X, target;
  std::vector<std::int64_t> classes;
  std::vector<std::vector<T>> W;

  int index(const std::string& name) const {
    for (size_t p = 0; p < shapes.size(); ++p)
      if (shapes[p].name == name) return static_cast<int>(p);
    throw std::logic_error("no parameter " + name);
  }
  index_t size() const {
    index_t P = 0;
    for (const auto& p : shapes) P += p.size();
    return P;
  }
  std::vector<const T*> weights() const {
    std::vector<const T*> w;
    for (const auto& a : W) w.push_back(a.data());
    return w;
  }
  bh::block::Model<T> evaluate(const bh::block::Dims& D, index_t B, T eps) const {
    return bh::block::Model<T>(bh::block::Spec{}, D, B, X.data(), weights(), eps);
  }
  bh::block::Target<T> tgt(Loss kind) const {
    bh::block::Target<T> t;
    t.loss = kind;
    t.values = kind == Loss::mse ? target.data() : nullptr;
    t.classes = kind == Loss::cross_entropy ? classes.data() : nullptr;
    return t;
  }
};

template <class T>
BlockData<T> block_data(std::mt19937_64& rng, const bh::block::Dims& D, index_t B) {
  BlockData<T> data;
  data.shapes = bh::block::parameters(bh::block::Spec{}, D);
  data.X = randn<T>(rng, B * D.L * D.d);
  data.target = randn<T>(rng, B * D.L * D.d);
  std::uniform_int_distribution<std::int64_t> cls(0, D.d - 1);
  for (index_t t = 0; t < B * D.L; ++t) data.classes.push_back(cls(rng));
  for (const auto& p : data.shapes) data.W.push_back(randn<T>(rng, p.size(), 1.0 / std::sqrt(static_cast<double>(p.rows))));
  return data;
}

template <class T>
void check_block(std::mt19937_64& rng, const BlockCase<T>& bc) {
  namespace blk = bh::block;
  const blk::Dims& D = bc.D;
  const std::string ctx = std::string("block ") + type_name<T>() + " " + shape({D.L, D.d, D.dk, D.dff}) + " B=" +
                          std::to_string(bc.B) + (bc.kind == Loss::mse ? " mse" : " cross_entropy") +
                          " eps=" + std::to_string(static_cast<double>(bc.eps));
  const BlockData<T> data = block_data<T>(rng, D, bc.B);
  const auto target = data.tgt(bc.kind);
  const index_t P = data.size();
  const blk::Selection all(data.shapes.size(), true);
  auto hessian = [&](blk::Part part, const blk::Selection& wrt, T* out) {
    data.evaluate(D, bc.B, bc.eps).loss_hessian(target, part, wrt, out);
  };

  std::vector<T> grad(P), H(P * P), H1(P * P), Ho(P * P), Hf(P * P);
  const T value = data.evaluate(D, bc.B, bc.eps).loss_gradient(target, grad.data());
  CHECK(std::isfinite(value) && all_finite(grad), ctx);
  with_thread_counts([&](int threads) { hessian(blk::Part::full, all, (threads == 1 ? H1 : H).data()); });
  CHECK(H == H1, ctx + " Hessian independent of the thread count (bit for bit)");
  hessian(blk::Part::outer, all, Ho.data());
  hessian(blk::Part::functional, all, Hf.data());
  CHECK(all_finite(H) && all_finite(Ho) && all_finite(Hf), ctx);
  bool sym = true;
  for (index_t i = 0; i < P; ++i)
    for (index_t j = 0; j < i; ++j) sym &= H[i * P + j] == H[j * P + i] && Ho[i * P + j] == Ho[j * P + i];
  CHECK(sym, ctx + " Hessian symmetric (bit for bit)");
  std::vector<T> sum(P * P);
  for (index_t k = 0; k < P * P; ++k) sum[k] = Ho[k] + Hf[k];
  CHECK(rel_diff(sum, H) < 100 * tol<T>(), ctx + " outer + functional = full");

  // A selection (W_V and W_2) is the matching sub-block of the full Hessian.
  {
    const int wv = data.index("W_V"), w2 = data.index("W_2");
    blk::Selection sel(data.shapes.size(), false);
    sel[wv] = sel[w2] = true;
    index_t Ps = 0;
    auto model = data.evaluate(D, bc.B, bc.eps);
    const std::vector<index_t> off = model.graph().offsets(sel, &Ps), full_off = model.graph().offsets(all);
    std::vector<T> Hs(Ps * Ps), ref(Ps * Ps);
    hessian(blk::Part::full, sel, Hs.data());
    for (int p : {wv, w2})
      for (int q : {wv, w2})
        for (index_t a = 0; a < data.shapes[p].size(); ++a)
          for (index_t b = 0; b < data.shapes[q].size(); ++b)
            ref[(off[p] + a) * Ps + off[q] + b] = H[(full_off[p] + a) * P + full_off[q] + b];
    CHECK(Ps == data.shapes[wv].size() + data.shapes[w2].size() && rel_diff(Hs, ref) < 100 * tol<T>(),
          ctx + " selected parameters = sub-block");
  }

  // The matrix-free operator (engine/loss.hpp): H V for three columns, in every part, against the
  // dense Hessian; columns run in parallel on reused scratch, bit-identical at any thread count.
  {
    const index_t k = 3;
    const auto V = randn<T>(rng, P * k);
    for (auto [part, dense] : {std::pair{blk::Part::full, &H}, {blk::Part::outer, &Ho}, {blk::Part::functional, &Hf}}) {
      const blk::LossHessianOperator<T> op(data.evaluate(D, bc.B, bc.eps), target, part, all);
      std::vector<T> HV(P * k), HV1(P * k), ref(P * k, T(0));
      with_thread_counts([&](int threads) { op.apply_columns(V.data(), k, (threads == 1 ? HV1 : HV).data()); });
      op.apply_columns(V.data(), k, HV.data());  // a second product reuses the operator's scratch
      for (index_t i = 0; i < P; ++i)
        for (index_t j = 0; j < P; ++j)
          for (index_t c = 0; c < k; ++c) ref[i * k + c] += (*dense)[i * P + j] * V[j * k + c];
      CHECK(HV == HV1, ctx + " H V independent of the thread count (bit for bit)");
      CHECK(rel_diff(HV, ref) < 100 * tol<T>(), ctx + " H V = dense H times V");
    }
  }

  if constexpr (std::is_same_v<T, double>) {
    // Central differences along a random direction v of all weights: of the loss (against the
    // gradient) and of the gradient (against H v).
    const auto v = randn<T>(rng, P);
    const double h = 1e-5;
    auto shifted = [&](double step, std::vector<T>* g) {
      BlockData<T> moved = data;
      index_t k = 0;
      for (auto& a : moved.W)
        for (T& w : a) w += step * v[k++];
      return moved.evaluate(D, bc.B, bc.eps).loss_gradient(moved.tgt(bc.kind), g ? g->data() : static_cast<T*>(nullptr));
    };
    std::vector<T> gp(P), gm(P), Hv(P, T(0)), fd(P);
    const double lp = shifted(h, &gp), lm = shifted(-h, &gm);
    double gv = 0;
    for (index_t k = 0; k < P; ++k) gv += grad[k] * v[k];
    CHECK(std::abs((lp - lm) / (2 * h) - gv) < 1e-6 * std::max(1.0, std::abs(gv)),
          ctx + " finite differences of the loss = gradient . v");
    for (index_t i = 0; i < P; ++i) {
      for (index_t j = 0; j < P; ++j) Hv[i] += H[i * P + j] * v[j];
      fd[i] = (gp[i] - gm[i]) / (2 * h);
    }
    CHECK(rel_diff(fd, Hv, 1e-9) < 1e-5, ctx + " finite differences of the gradient = H v");
  }
}

// Blocks of the family (pieces for heads, a moving attention input, RMSNorm, every node option):
// the Hessian in every part is symmetric, outer + functional = full, the operator equals the dense
// Hessian, and the loss gradient matches central differences (double). pooled: the loss is
// pooled_cross_entropy through a random head of 3 classes (the outer part's PooledSite).
template <class T>
void check_family(std::mt19937_64& rng, const bh::block::Spec& spec, const bh::block::Dims& D, index_t B, T eps,
                  bool pooled = false) {
  namespace blk = bh::block;
  const std::string ctx = std::string("family ") + type_name<T>() +
                          (spec.attention_only ? " attention-only" : spec.norm_position == bh::block::NormPosition::pre ? " pre" : " post") +
                          (spec.norm == bh::block::Norm::rmsnorm ? " rms" : "") + " heads=" + std::to_string(spec.heads) +
                          (pooled ? " pooled" : "");
  const auto shapes = blk::parameters(spec, D);
  std::vector<std::vector<T>> W;
  for (const auto& p : shapes) W.push_back(randn<T>(rng, p.size(), 1.0 / std::sqrt(static_cast<double>(p.rows))));
  std::vector<const T*> w;
  for (auto& a : W) w.push_back(a.data());
  const auto X = randn<T>(rng, B * D.L * D.d), target = randn<T>(rng, B * D.L * D.d);
  blk::Target<T> tgt;
  tgt.values = target.data();
  const index_t classes = 3;
  const auto head_weight = randn<T>(rng, D.d * classes), head_bias = randn<T>(rng, classes);
  std::vector<std::int64_t> labels;
  for (index_t b = 0; b < B; ++b) labels.push_back(b % classes);
  if (pooled) {
    tgt.loss = Loss::pooled_cross_entropy;
    tgt.values = nullptr;
    tgt.classes = labels.data();
    tgt.classifier = bh::heads::Classifier<T>{head_weight.data(), head_bias.data(), classes};
  }
  index_t P = 0;
  for (const auto& p : shapes) P += p.size();
  const blk::Selection all(shapes.size(), true);
  std::vector<T> H(P * P), Ho(P * P), Hf(P * P);
  for (auto [part, out] : {std::pair{blk::Part::full, &H}, {blk::Part::outer, &Ho}, {blk::Part::functional, &Hf}}) {
    blk::Model<T>(spec, D, B, X.data(), w, eps).loss_hessian(tgt, part, all, out->data());
  }
  bool sym = true;
  for (index_t i = 0; i < P; ++i)
    for (index_t j = 0; j < i; ++j) sym &= H[i * P + j] == H[j * P + i];
  for (index_t i = 0; i < P; ++i)
    for (index_t j = 0; j < i; ++j) sym &= Ho[i * P + j] == Ho[j * P + i];
  CHECK(all_finite(H) && all_finite(Ho) && sym, ctx + " Hessian and its outer part finite and symmetric (bit for bit)");
  std::vector<T> sum(P * P);
  for (index_t k = 0; k < P * P; ++k) sum[k] = Ho[k] + Hf[k];
  CHECK(rel_diff(sum, H) < 100 * tol<T>(), ctx + " outer + functional = full");
  // The diagonal from the factors alone (engine/diagonal.hpp) in every part.
  for (auto [part, dense] : {std::pair{blk::Part::full, &H}, {blk::Part::outer, &Ho}, {blk::Part::functional, &Hf}}) {
    std::vector<T> diag(P), ref(P);
    blk::Model<T>(spec, D, B, X.data(), w, eps).loss_hessian_diagonal(tgt, part, all, diag.data());
    for (index_t i = 0; i < P; ++i) ref[i] = (*dense)[i * P + i];
    CHECK(rel_diff(diag, ref) < 100 * tol<T>(), ctx + " diagonal = the dense Hessian's");
  }
  const index_t k = 2;
  const auto V = randn<T>(rng, P * k);
  for (auto [part, dense] : {std::pair{blk::Part::full, &H}, {blk::Part::outer, &Ho}}) {
    const blk::LossHessianOperator<T> op(blk::Model<T>(spec, D, B, X.data(), w, eps), tgt, part, all);
    std::vector<T> HV(P * k), ref(P * k, T(0));
    op.apply_columns(V.data(), k, HV.data());
    for (index_t i = 0; i < P; ++i)
      for (index_t j = 0; j < P; ++j)
        for (index_t c = 0; c < k; ++c) ref[i * k + c] += (*dense)[i * P + j] * V[j * k + c];
    CHECK(rel_diff(HV, ref) < 100 * tol<T>(), ctx + " H V = dense H times V");
  }
  if constexpr (std::is_same_v<T, double>) {
    std::vector<T> grad(P);
    blk::Model<T>(spec, D, B, X.data(), w, eps).loss_gradient(tgt, grad.data());
    const auto v = randn<T>(rng, P);
    auto loss_at = [&](double step) {
      std::vector<std::vector<T>> moved = W;
      std::vector<const T*> mw;
      index_t at = 0;
      for (auto& a : moved) {
        for (T& x : a) x += step * v[at++];
        mw.push_back(a.data());
      }
      return blk::Model<T>(spec, D, B, X.data(), mw, eps).loss_gradient(tgt, static_cast<T*>(nullptr));
    };
    double gv = 0;
    for (index_t i = 0; i < P; ++i) gv += grad[i] * v[i];
    const double h = 1e-5;
    CHECK(std::abs((loss_at(h) - loss_at(-h)) / (2 * h) - gv) < 1e-6 * std::max(1.0, std::abs(gv)),
          ctx + " finite differences of the loss = gradient . v");
  }
}

// dZ/dW_p and d2Z/dW_i dW_j of one sample (small: output_hessian assembles one Hessian per entry).
inline void check_block_output_derivatives(std::mt19937_64& rng) {
  namespace blk = bh::block;
  const blk::Dims D{3, 2, 3, 4};
  const std::string ctx = "block output derivatives double " + shape({D.L, D.d, D.dk, D.dff});
  const BlockData<double> data = block_data<double>(rng, D, 1);
  const double eps = 1e-5;
  blk::Model<double> e = data.evaluate(D, 1, eps);
  const index_t m = D.L * D.d;
  for (int p = 0; p < static_cast<int>(data.shapes.size()); ++p) {
    const index_t n = data.shapes[p].size();
    std::vector<double> J(m * n);
    e.jacobian(p, J.data());
    const double h = 1e-6;
    double worst = 0;
    for (index_t k = 0; k < n; ++k) {
      BlockData<double> moved = data;
      moved.W[p][k] += h;
      const auto ep = moved.evaluate(D, 1, eps);
      moved.W[p][k] -= 2 * h;
      const auto em = moved.evaluate(D, 1, eps);
      const double *Zp = ep.output(), *Zm = em.output();
      for (index_t o = 0; o < m; ++o) worst = std::max(worst, std::abs((Zp[o] - Zm[o]) / (2 * h) - J[o * n + k]));
    }
    CHECK(all_finite(J) && worst < 1e-6 * std::max(1.0, max_abs(J)),
          ctx + " finite differences of dZ/d" + data.shapes[p].name);
  }
  const int wq = data.index("W_Q"), wk = data.index("W_K"), w1 = data.index("W_1"), w2 = data.index("W_2");
  for (auto [i, j] : {std::pair<int, int>{wq, wq}, {wk, w1}, {w2, w2}}) {
    const index_t ni = data.shapes[i].size(), nj = data.shapes[j].size();
    std::vector<double> out(m * ni * nj);
    e.output_hessian(i, j, out.data());
    bool sym = true;
    if (i == j)
      for (index_t o = 0; o < m; ++o)
        for (index_t a = 0; a < ni; ++a)
          for (index_t b = 0; b < a; ++b) sym &= out[(o * ni + a) * nj + b] == out[(o * ni + b) * nj + a];
    CHECK(all_finite(out) && sym, ctx + " output Hessian " + std::to_string(i) + "," + std::to_string(j));
  }
}

// The checks a model of several parts shares, model_at(weights) making it at one set of weights:
// H v over every parameter against central differences of the gradient along v.
template <class MakeModel>
void check_hv_against_differences(std::mt19937_64& rng, const MakeModel& model_at,
                                  const std::vector<std::vector<double>>& W, const bh::block::Target<double>& target,
                                  const std::string& ctx) {
  namespace blk = bh::block;
  index_t P = 0;
  for (const auto& a : W) P += static_cast<index_t>(a.size());
  const auto v = randn<double>(rng, P);
  std::vector<double> Hv(P), gp(P), gm(P), fd(P);
  const blk::Selection all(W.size(), true);
  blk::LossHessianOperator<double>(model_at(W), target, blk::Part::full, all).apply(v.data(), Hv.data());
  const double h = 1e-5;
  for (double step : {h, -h}) {
    auto moved = W;
    index_t k = 0;
    for (auto& a : moved)
      for (double& x : a) x += step * v[k++];
    model_at(moved).loss_gradient(target, (step > 0 ? gp : gm).data());
  }
  for (index_t i = 0; i < P; ++i) fd[i] = (gp[i] - gm[i]) / (2 * h);
  CHECK(all_finite(Hv) && rel_diff(fd, Hv, 1e-9) < 1e-5, ctx + " finite differences of the gradient = H v");
}

// The dense Hessian over the parameters whose names start with one of `prefixes` (or are one of
// them) against the operator on them.
template <class MakeModel>
void check_dense_against_operator(std::mt19937_64& rng, const MakeModel& model_at,
                                  const std::vector<std::vector<double>>& W,
                                  const std::vector<bh::block::ParamShape>& shapes,
                                  const bh::block::Target<double>& target, std::initializer_list<const char*> prefixes,
                                  const std::string& ctx) {
  namespace blk = bh::block;
  blk::Selection chosen(shapes.size(), false);
  index_t n = 0;
  for (size_t p = 0; p < shapes.size(); ++p) {
    for (const char* prefix : prefixes) chosen[p] = chosen[p] || shapes[p].name.rfind(prefix, 0) == 0;
    n += chosen[p] ? shapes[p].size() : 0;
  }
  std::vector<double> H(n * n), HU(n), ref(n, 0.0);
  model_at(W).loss_hessian(target, blk::Part::full, chosen, H.data());
  const auto u = randn<double>(rng, n);
  blk::LossHessianOperator<double>(model_at(W), target, blk::Part::full, chosen).apply(u.data(), HU.data());
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < n; ++j) ref[i] += H[i * n + j] * u[j];
  CHECK(rel_diff(HU, ref) < 1e-12, ctx + " the top parameters' dense Hessian = its operator");
}

// Random weights for a model's parameters (1/sqrt(rows) scaled; the embeddings, w*, unscaled).
inline std::vector<std::vector<double>> random_weights(std::mt19937_64& rng,
                                                       const std::vector<bh::block::ParamShape>& shapes) {
  std::vector<std::vector<double>> W;
  for (const auto& p : shapes)
    W.push_back(randn<double>(rng, p.size(), p.name[0] == 'w' ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.rows))));
  return W;
}

// K-FAC's factors of every weight (engine/kfac.hpp: the head's square root backpropagated column
// by column), both flavours: present for each weight (and bias) the model applies to every token,
// symmetric.
template <class MakeModel>
void check_kfac(const MakeModel& model_at, const std::vector<std::vector<double>>& W,
                const std::vector<bh::block::ParamShape>& shapes, const bh::block::Target<double>& target,
                index_t expected, const std::string& ctx) {
  const bh::block::Selection all(shapes.size(), true);
  for (bool reduce : {false, true}) {
    const auto factors = model_at(W).kfac_factors(target, all, reduce);
    CHECK(static_cast<index_t>(factors.size()) == expected, ctx + " K-FAC factors for every weight");
    double asymmetry = 0;
    for (const auto& f : factors)
      for (const auto& [side, n] : {std::pair{&f.A, static_cast<index_t>(std::sqrt(f.A.size()))}, std::pair{&f.G, f.cols}})
        for (index_t i = 0; i < n; ++i)
          for (index_t j = 0; j < n; ++j) asymmetry = std::max(asymmetry, std::abs((*side)[i * n + j] - (*side)[j * n + i]));
    CHECK(asymmetry < 1e-12, ctx + " K-FAC's A and G symmetric");
  }
}

// The working-memory estimate of every call (engine/working_memory.hpp) from a graph wired for its
// shapes only: nothing is read through its null input, ids or weights (the sanitizers would say),
// and a dense Hessian needs at least what the passes of the gradient do.
inline void check_working_memory(const bh::block::Spec& spec, const bh::block::Dims& D, const bh::block::Stack& stack,
                                 index_t B, const bh::block::Target<double>& target, const std::string& ctx) {
  using Call = bh::engine::Call;
  const bh::block::Selection all(bh::block::parameters(spec, D, stack).size(), true);
  auto bytes = [&](Call call, const bh::block::Target<double>* t) {
    return bh::block::Model<double>::working_memory(spec, D, stack, B, t, call, bh::block::Part::full, all, 4, 2);
  };
  const index_t gradient = bytes(Call::gradient, &target);
  CHECK(gradient > 0, ctx + " working memory of the gradient");
  for (Call call : {Call::loss_hessian, Call::diagonal, Call::products})
    CHECK(bytes(call, &target) >= gradient, ctx + " working memory of a curvature call covers the gradient's");
  CHECK(bytes(Call::jacobian, nullptr) > 0, ctx + " working memory of a Jacobian");
}

// The weights' data pointers, in order.
inline std::vector<const double*> pointers(const std::vector<std::vector<double>>& W) {
  std::vector<const double*> w;
  for (const auto& a : W) w.push_back(a.data());
  return w;
}

// A stack of three GPT-2-like blocks and a final norm through Model::stack: H v against central
// differences of the gradient (every parameter), the dense Hessian of the last layer and the final
// norm against the operator on them, and with a lower layer's parameters (whose factors do not reach
// through another block's attention: the Hessian and diagonal come from products, engine/loss.hpp)
// too, the diagonal's product limit refused.
inline void check_stack(std::mt19937_64& rng) {
  namespace blk = bh::block;
  blk::Spec spec;
  spec.norm_position = blk::NormPosition::pre;
  spec.norm_affine = spec.bias = spec.out_proj = spec.causal = true;
  spec.heads = 2;
  spec.activation = bh::activation::Kind::gelu_tanh;
  const blk::Dims D{4, 6, 3, 7, 3};
  const blk::Stack stack{3, /*final_norm=*/true};
  const index_t B = 2;
  const double eps = 1e-5;
  const std::string ctx = "stack of 3 blocks and ln_f double";
  const auto shapes = blk::parameters(spec, D, stack);
  CHECK(shapes.front().name == "h.0.W_Q" && shapes.back().name == "ln_f.beta", ctx + " prefixed names");
  const auto W = random_weights(rng, shapes);
  const auto X = randn<double>(rng, B * D.L * D.d), target = randn<double>(rng, B * D.L * D.d);
  blk::Target<double> mse;
  mse.values = target.data();
  auto model_at = [&](const std::vector<std::vector<double>>& weights) {
    return blk::Model<double>::stack(spec, D, stack, B, X.data(), pointers(weights), eps);
  };
  check_hv_against_differences(rng, model_at, W, mse, ctx);
  check_dense_against_operator(rng, model_at, W, shapes, mse, {"h.2.", "ln_f."}, ctx);
  check_kfac(model_at, W, shapes, mse, 3 * 12, ctx);  // W_Q, W_K, W_V, W_O, W_1, W_2 and biases per layer
  check_dense_against_operator(rng, model_at, W, shapes, mse, {"h.0.", "h.2.", "ln_f."}, ctx + " with layer 0");
  blk::Selection first(shapes.size(), false);
  first[0] = true;  // h.0.W_Q: under layers 1 and 2's attention
  const index_t n = shapes[0].size();
  std::vector<double> H(n * n), diag(n);
  model_at(W).loss_hessian(mse, blk::Part::full, first, H.data());
  model_at(W).loss_hessian_diagonal(mse, blk::Part::full, first, diag.data());
  double worst = 0;
  for (index_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(diag[i] - H[i * n + i]));
  CHECK(worst == 0.0, ctx + " a lower layer's diagonal = its dense Hessian's");
  CHECK(throws<std::invalid_argument>(
            [&] { model_at(W).loss_hessian_diagonal(mse, blk::Part::full, first, diag.data(), n - 1); }),
        ctx + " a lower layer's diagonal above the product limit refused");
  // Its Jacobian, one forward tangent per entry (engine/derivatives.hpp), against central differences
  // of one sample's output; its output Hessian, which needs the factors, refused.
  auto one_sample = [&](const std::vector<std::vector<double>>& weights) {
    return blk::Model<double>::stack(spec, D, stack, 1, X.data(), pointers(weights), eps);
  };
  auto model = one_sample(W);
  const index_t rows = model.tokens() * model.output_width();
  std::vector<double> J(rows * n);
  model.jacobian(0, J.data());
  double gap = 0;
  for (index_t k = 0; k < n; k += 5) {
    const double h = 1e-6;
    auto Wp = W, Wm = W;
    Wp[0][k] += h;
    Wm[0][k] -= h;
    const auto up = one_sample(Wp), down = one_sample(Wm);
    for (index_t r = 0; r < rows; ++r)
      gap = std::max(gap, std::abs((up.output()[r] - down.output()[r]) / (2 * h) - J[r * n + k]));
  }
  CHECK(gap < 1e-6, ctx + " a lower layer's Jacobian = central differences");
  std::vector<double> O(rows * n * n);
  CHECK(throws<std::invalid_argument>([&] { one_sample(W).output_hessian(0, 0, O.data()); }),
        ctx + " a lower layer's output Hessian refused");
}

// A language model through Model::language_model: token ids, wte and wpe, two blocks, ln_f and the LM
// head tied to wte (one parameter written by two nodes through the graph's slots), under the
// next-token loss with ignored labels: H v against central differences of the gradient (every
// parameter), the last layer's dense Hessian against the operator, with the embeddings too (from
// products), and bad ids and all-ignored labels refused.
inline void check_language_model(std::mt19937_64& rng) {
  namespace blk = bh::block;
  blk::Spec spec;
  spec.norm_position = blk::NormPosition::pre;
  spec.norm_affine = spec.bias = spec.out_proj = spec.causal = true;
  spec.heads = 2;
  spec.activation = bh::activation::Kind::gelu_tanh;
  const blk::Dims D{5, 6, 3, 7, 3};
  const blk::Stack stack{2, /*final_norm=*/true, /*vocab=*/9, /*positions=*/7, /*lm_head=*/true};
  const index_t B = 2;
  const double eps = 1e-5;
  const std::string ctx = "language model double";
  const auto shapes = blk::parameters(spec, D, stack);
  CHECK(shapes[0].name == "wte" && shapes[1].name == "wpe" && shapes.back().name == "ln_f.beta", ctx + " names");
  const auto W = random_weights(rng, shapes);
  std::vector<std::int64_t> ids(B * D.L), labels(B * D.L);
  for (index_t t = 0; t < B * D.L; ++t) ids[t] = labels[t] = static_cast<std::int64_t>(rng() % 9);
  labels[3] = -100;
  blk::Target<double> next;
  next.loss = bh::heads::kNextToken;
  next.classes = labels.data();
  auto model_with = [&](const std::vector<std::vector<double>>& weights, const std::vector<std::int64_t>& at) {
    return blk::Model<double>::language_model(spec, D, stack, B, at.data(), pointers(weights), eps);
  };
  auto model_at = [&](const std::vector<std::vector<double>>& weights) { return model_with(weights, ids); };
  check_hv_against_differences(rng, model_at, W, next, ctx);
  check_dense_against_operator(rng, model_at, W, shapes, next, {"h.1.", "ln_f."}, ctx);
  check_kfac(model_at, W, shapes, next, 2 * 12 + 2, ctx);  // and wpe, and wte as the tied LM head's weight
  check_working_memory(spec, D, stack, B, next, ctx);
  // wte (tied to the LM head) and wpe: out of the factors' reach, from products.
  check_dense_against_operator(rng, model_at, W, shapes, next, {"wte", "wpe", "h.1."}, ctx + " with the embeddings");
  auto bad = ids;
  bad[4] = 9;
  CHECK(throws<std::invalid_argument>([&] { model_with(W, bad); }), ctx + " a token id out of range refused");
  std::vector<std::int64_t> ignored(B * D.L, -100);
  next.classes = ignored.data();
  index_t P = 0;
  for (const auto& shape : shapes) P += shape.size();
  std::vector<double> grad(P);
  CHECK(throws<std::invalid_argument>([&] { model_at(W).loss_gradient(next, grad.data()); }),
        ctx + " every label ignored refused");
}

// A ViT through Model::stack: patches embedded by W_E, b_E, (a class token,) learned positions, two
// blocks, ln_f and a classifier of its own (W_C, b_C), under the pooled loss (the pooled head with
// the identity, or the class token's cross-entropy): H v against central differences of the
// gradient, and the dense Hessian over the top block, ln_f and the classifier against the operator.
inline void check_vit(std::mt19937_64& rng, bool class_token) {
  namespace blk = bh::block;
  blk::Spec spec;
  spec.norm_position = blk::NormPosition::pre;
  spec.norm_affine = spec.bias = spec.out_proj = true;
  spec.heads = 2;
  spec.activation = bh::activation::Kind::gelu;
  const blk::Dims D{4, 6, 3, 7, 3};
  blk::Stack stack{2, /*final_norm=*/true};
  stack.patch_dim = 5, stack.positions = 6, stack.classes = 3, stack.class_token = class_token;
  const index_t B = 3;
  const double eps = 1e-5;
  const std::string ctx = class_token ? "ViT with a class token double" : "ViT double";
  const auto shapes = blk::parameters(spec, D, stack);
  CHECK(shapes[0].name == "W_E" && shapes[class_token ? 3 : 2].name == "wpe" && shapes.back().name == "b_C",
        ctx + " names");
  const auto W = random_weights(rng, shapes);
  const auto X = randn<double>(rng, B * D.L * stack.patch_dim);
  std::vector<std::int64_t> labels{0, 2, 1};
  blk::Target<double> pooled;
  pooled.loss = bh::heads::kPooledCrossEntropy;
  pooled.classes = labels.data();
  pooled.classifier.classes = stack.classes;  // the model's own: no W_C, b_C in the target
  pooled.classifier.first_token = class_token;
  auto model_at = [&](const std::vector<std::vector<double>>& weights) {
    return blk::Model<double>::stack(spec, D, stack, B, X.data(), pointers(weights), eps);
  };
  check_hv_against_differences(rng, model_at, W, pooled, ctx);
  check_dense_against_operator(rng, model_at, W, shapes, pooled, {"h.1.", "ln_f.", "W_C", "b_C"}, ctx);
  check_kfac(model_at, W, shapes, pooled, 2 * 12 + 5 + class_token, ctx);  // and W_E, b_E, wpe, W_C, b_C (cls_token)
  check_working_memory(spec, D, stack, B, pooled, ctx);
}

// Bad input must end in the documented exceptions, without leaking what was allocated before.
inline void check_block_errors(std::mt19937_64& rng) {
  namespace blk = bh::block;
  const blk::Dims D{4, 3, 2, 5};
  BlockData<double> data = block_data<double>(rng, D, 2);
  std::vector<double> grad(200 * 200);
  const blk::Selection all(data.shapes.size(), true);
  auto gradient = [&](const BlockData<double>& at, const blk::Dims& dims, index_t B, Loss kind) {
    return at.evaluate(dims, B, 0.0).loss_gradient(at.tgt(kind), grad.data());
  };
  CHECK(throws<std::invalid_argument>([&] { gradient(data, blk::Dims{4, 0, 2, 5}, 1, Loss::mse); }),
        "block d = 0");
  data.classes[3] = D.d;  // out of range
  CHECK(throws<std::invalid_argument>([&] {
          data.evaluate(D, 2, 0.0).loss_hessian(data.tgt(Loss::cross_entropy), blk::Part::full, all, grad.data());
        }),
        "block class index out of range");
  data.classes[3] = 0;
  for (const char* name : {"W_Q", "W_K"})  // X W_Q W_K^T X^T overflows: the attention logits are infinite
    for (double& w : data.W[data.index(name)]) w *= 1e160;
  CHECK(throws<bh::non_finite_error>([&] { gradient(data, D, 2, Loss::mse); }), "block overflowing logits");
  // d = 1 without eps: every row of X + F is constant, LayerNorm is not differentiable.
  const blk::Dims D1{3, 1, 2, 2};
  const BlockData<double> one = block_data<double>(rng, D1, 1);
  CHECK(throws<std::domain_error>([&] { gradient(one, D1, 1, Loss::mse); }), "block d = 1 without eps");
}

template <class T>
void run_all(std::mt19937_64& rng) {
  for (int threads : {1, 3}) {
    bh::parallel::set_num_threads(threads);
    // LayerNorm: L = 1, d = 1 (needs eps), odd sizes, and rows enough for the parallel loops.
    check_layernorm<T>(rng, 1, 1, T(0), false);
    check_layernorm<T>(rng, 1, 1, T(1e-3), true);
    check_layernorm<T>(rng, 1, 5, T(0), false);
    check_layernorm<T>(rng, 3, 7, T(1e-5), true);
    check_layernorm<T>(rng, 65, 16, T(0), true);
    // Softmax: a single entry, odd sizes, and many rows.
    check_softmax<T>(rng, 1, 1);
    check_softmax<T>(rng, 3, 5);
    check_softmax<T>(rng, 70, 9);
    // The standalone attention, FFN and commutation headers in double only: in float they would
    // add half a minute to the build for code the float block below mostly shares.
    if constexpr (std::is_same_v<T, double>) {
      check_commutation<T>(rng, 1, 1);
      check_commutation<T>(rng, 3, 5);
      check_commutation<T>(rng, 40, 33);
      // Attention: L = 1, d = 1, d_k != d, d_v != d, and a size with parallel loops.
      check_attention<T>(rng, 1, 1, 1, 1);
      check_attention<T>(rng, 1, 3, 2, 3);
      check_attention<T>(rng, 5, 3, 4, 2);
      check_attention<T>(rng, 24, 8, 5, 8);
      // FFN: L = 1, d = 1, e != d, and a size with parallel loops.
      check_ffn<T>(rng, 1, 1, 1, 1);
      check_ffn<T>(rng, 3, 2, 5, 3);
      check_ffn<T>(rng, 80, 6, 11, 7);
    }
  }
  bh::parallel::set_num_threads(2);
  using K = Loss;
  // The block: L = 1, d = 1 (with eps), d_k != d, odd sizes, batches, both losses; the last two are
  // large enough for the parallel assembly (P = 544 and 225).
  check_block<T>(rng, {{1, 3, 2, 4}, 1, K::mse, T(0)});
  check_block<T>(rng, {{1, 1, 1, 1}, 2, K::mse, T(1e-3)});
  check_block<T>(rng, {{3, 1, 2, 3}, 1, K::cross_entropy, T(1e-2)});
  check_block<T>(rng, {{5, 3, 4, 7}, 3, K::cross_entropy, T(0)});
  check_block<T>(rng, {{16, 8, 6, 24}, 2, K::mse, T(1e-5)});
  check_block<T>(rng, {{9, 5, 7, 13}, 2, K::cross_entropy, T(0)});
  // The family: everything on, pre- and post-LN, two heads, RMSNorm.
  bh::block::Spec everything;
  everything.norm_affine = everything.bias = everything.out_proj = everything.causal = true;
  everything.heads = 2;
  everything.activation = bh::activation::Kind::gelu_tanh;
  check_family<T>(rng, everything, {5, 6, 3, 7, 2}, 2, T(1e-3));
  check_family<T>(rng, everything, {5, 6, 3, 7, 2}, 3, T(1e-3), /*pooled=*/true);
  everything.norm_position = bh::block::NormPosition::pre;
  check_family<T>(rng, everything, {5, 6, 3, 7, 2}, 2, T(1e-3));
  check_family<T>(rng, everything, {5, 6, 3, 7, 2}, 1, T(1e-3), /*pooled=*/true);
  everything.norm = bh::block::Norm::rmsnorm;
  everything.activation = bh::activation::Kind::silu;
  check_family<T>(rng, everything, {4, 4, 2, 5, 0}, 1, T(1e-3));
  // The attention sublayer alone (the paper's Thm 1 layer) with every attention option; d_ff = 0:
  // it has no FFN.
  bh::block::Spec attention;
  attention.attention_only = attention.bias = attention.out_proj = attention.causal = true;
  attention.heads = 2;
  check_family<T>(rng, attention, {5, 6, 3, 0, 2}, 2, T(0));
  check_family<T>(rng, attention, {5, 6, 3, 0, 2}, 3, T(0), /*pooled=*/true);
}

}  // namespace sanitize

