// RMSNorm of one row u of width d: n = u / r, r = sqrt(mean(u^2) + eps) (then gamma * n).
// With n and r, per row:
//   J0 = (I - n n^T / d) / r                                  (symmetric)
//   d2 n_a / du_b du_c = (-d_ab n_c - d_ac n_b - d_bc n_a + 3 n_a n_b n_c / d) / (d r^2)
// (d_xy the Kronecker delta), from dr/du_b = n_b / d.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/math.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::rmsnorm {

template <class T>
BLOCKHESS_HD T normalize_row(const T* u, index_t d, T eps, T* n) {
  T top = 0;  // scaled by the largest entry, so that squaring neither over- nor underflows
  for (index_t a = 0; a < d; ++a) top = top < math::abs(u[a]) ? math::abs(u[a]) : top;
  T r = math::sqrt(eps);
  if (top > T(0)) {
    T sum = 0;
    for (index_t a = 0; a < d; ++a) sum += (u[a] / top) * (u[a] / top);
    r = top * math::sqrt(sum / static_cast<T>(d) + eps / top / top);
  }
  for (index_t a = 0; a < d; ++a) n[a] = u[a] / r;
  return r;
}

namespace detail {
// A zero row with eps = 0 has no derivative: an error naming the first.
template <class T>
void check_scales(const T* r, index_t L) {
  for (index_t i = 0; i < L; ++i)
    if (!(r[i] > T(0)) || !std::isfinite(r[i]))
      throw std::domain_error("rmsnorm: row " + std::to_string(i) + " is zero (or not finite); pass eps > 0 to make "
                              "RMSNorm differentiable there");
}
}  // namespace detail

// n (L, d) and r (L) of every row.
template <class T>
void normalize(const T* u, index_t L, index_t d, T eps, T* n, T* r) {
  blockhess::detail::parallel_for(L, d, [&](index_t i) { r[i] = normalize_row(u + i * d, d, eps, n + i * d); });
  detail::check_scales(r, L);
}

// J = diag(gamma) J0 (gamma may be null).
template <class T>
BLOCKHESS_HD void jacobian_row(const T* n, T r, const T* gamma, index_t d, T* J) {
  const T inv_d = T(1) / static_cast<T>(d);
  for (index_t a = 0; a < d; ++a) {
    const T scale = (gamma ? gamma[a] : T(1)) / r;
    for (index_t b = 0; b < d; ++b) J[a * d + b] = scale * ((a == b ? T(1) : T(0)) - n[a] * n[b] * inv_d);
  }
}

// C[b,c] = sum_a g_a gamma_a d2 n_a / du_b du_c.
template <class T>
void hessian_contract_row(const T* n, T r, const T* gamma, const T* g, index_t d, T* C) {
  const T inv_d = T(1) / static_cast<T>(d), pref = inv_d / r / r;
  T gn = 0;
  for (index_t a = 0; a < d; ++a) gn += g[a] * (gamma ? gamma[a] : T(1)) * n[a];
  for (index_t b = 0; b < d; ++b) {
    const T gb = g[b] * (gamma ? gamma[b] : T(1));
    for (index_t c = b; c < d; ++c) {
      const T gc = g[c] * (gamma ? gamma[c] : T(1));
      const T v = pref * (-gb * n[c] - gc * n[b] - (b == c ? gn : T(0)) + T(3) * gn * n[b] * n[c] * inv_d);
      C[b * d + c] = v;
      C[c * d + b] = v;
    }
  }
}

// u = J0^T g = (g - n (n . g) / d) / r; J0 is symmetric, so also the jvp.
template <class T>
BLOCKHESS_HD void vjp_row(const T* n, T r, const T* g, index_t d, T* u) {
  T ng = 0;
  for (index_t a = 0; a < d; ++a) ng += n[a] * g[a];
  ng /= static_cast<T>(d);
  for (index_t a = 0; a < d; ++a) u[a] = (g[a] - n[a] * ng) / r;
}

// The tangent of vjp_row's u with g fixed while the row's input moves by du: C du with C as above
// (gamma = 1), in O(d). (u and dn are unused; the signature is LayerNorm's.)
template <class T>
BLOCKHESS_HD void vjp_tangent_row(const T* n, T r, const T* g, const T*, const T* du, const T*, index_t d,
                                  T* out) {
  const T inv_d = T(1) / static_cast<T>(d), pref = inv_d / r / r;
  T gn = 0, ndu = 0, gdu = 0;
  for (index_t a = 0; a < d; ++a) gn += g[a] * n[a], ndu += n[a] * du[a], gdu += g[a] * du[a];
  for (index_t a = 0; a < d; ++a) out[a] = pref * (-g[a] * ndu - n[a] * gdu - du[a] * gn + T(3) * gn * n[a] * ndu * inv_d);
}

}  // namespace blockhess::rmsnorm
