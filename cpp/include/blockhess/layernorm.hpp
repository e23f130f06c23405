// Row-wise LayerNorm and its exact first and second derivatives (docs/derivation.md §3.1).
//
// Z_ia = gamma_a * y_ia + beta_a,  y_ia = (x_ia - mu_i) / sigma_i,  sigma_i = sqrt(var_i + eps),
// population variance. Only same-row derivatives are nonzero, so everything is stored per row:
//   Jacobian row block  J_i[a,b]   = gamma_a / sigma_i * (Pc_ab - y_ia y_ib / d)
//   Hessian  row block  H_i[a,b,c] = -gamma_a / (d sigma_i^2)
//                                    * (Pc_ab y_ic + Pc_ac y_ib + Pc_bc y_ia - 3/d y_ia y_ib y_ic)
// with the centring matrix Pc = I - 11^T / d. The (b,c) part of H is symmetric by construction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/math.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::layernorm {

// Scale-safe row statistics, shared by the CPU rows below and the CUDA kernels.
//
// The row is scaled by 2^-k (exact), with k the binary exponent of its largest |x|, so that its
// entries lie in (-1, 1): the mean and the variance are formed there, where no finite row can
// overflow (rows near 1e155 squared) or underflow (rows near 1e-160 squared). sigma is then
// brought back to the row's scale, with eps added by hypot (again without squaring the row).

// The factors 2^-k = s1 * s2, each finite for any exponent of a finite float, so x * s1 * s2 is
// exact for all but the entries far below the row's largest (which lose only bits that cannot
// matter at the row's scale).
template <class T>
struct Pow2Scale {
  T s1, s2;
  BLOCKHESS_HD explicit Pow2Scale(int k) : s1(math::ldexp(T(1), -k / 2)), s2(math::ldexp(T(1), -k + k / 2)) {}
  BLOCKHESS_HD T operator()(T x) const { return x * s1 * s2; }
};

// Below this standard deviation (relative to the row's largest entry) a row is constant up to the
// rounding of its mean: d * epsilon bounds the error of a d-term sum of entries below 1.
template <class T>
BLOCKHESS_HD T degenerate_spread(index_t d) {
  constexpr T epsilon = sizeof(T) == 4 ? T(1.1920928955078125e-07) : T(2.220446049250313e-16);
  return static_cast<T>(d) * epsilon;
}

// From the population variance var_s of the row scaled by 2^-k: returns sigma = sqrt(var + eps) in
// the row's own scale and sets divisor, by which the scaled centred entries are divided to give y.
// Returns 0 for a row that is constant up to rounding when eps == 0 (LayerNorm is not
// differentiable there; callers refuse it).
template <class T>
BLOCKHESS_HD T row_sigma(T var_s, int k, T eps, index_t d, T* divisor) {
  const T sd_s = math::sqrt(var_s);
  if (eps == T(0)) {
    *divisor = sd_s;
    return sd_s <= degenerate_spread<T>(d) ? T(0) : math::ldexp(sd_s, k);
  }
  const T root_eps = math::sqrt(eps);
  const T eps_s = math::ldexp(root_eps, -k);  // sqrt(eps) in the row's scaled units
  if (!math::isfinite(eps_s)) {  // the row lies below sqrt(eps) by more than the float range,
    *divisor = eps_s;            // so y is 0 and sigma is sqrt(eps) to within that range
    return root_eps;
  }
  const T s = math::hypot(sd_s, eps_s);
  *divisor = s;
  return math::ldexp(s, k);
}

// Normalise one row: writes y (the centred, scaled row) and returns sigma (0 for a row that is
// constant up to rounding when eps == 0).
template <class T>
BLOCKHESS_HD T normalize_row(const T* x, index_t d, T eps, T* y) {
  T top = 0;
  for (index_t a = 0; a < d; ++a) top = math::abs(x[a]) > top ? math::abs(x[a]) : top;
  const int k = math::exponent(top);
  const Pow2Scale<T> scaled(k);
  T mean = 0;
  for (index_t a = 0; a < d; ++a) mean += scaled(x[a]);
  mean /= static_cast<T>(d);
  T var = 0;
  for (index_t a = 0; a < d; ++a) {
    const T m = scaled(x[a]) - mean;
    y[a] = m;
    var += m * m;
  }
  T divisor = 0;
  const T sigma = row_sigma(var / static_cast<T>(d), k, eps, d, &divisor);
  for (index_t a = 0; a < d; ++a) y[a] /= divisor;
  return sigma;
}

// J_i[a,b] with scale = gamma_a / sigma_i. One entry, so that the CUDA kernels evaluate exactly
// the CPU's expression.
template <class T>
BLOCKHESS_HD T jacobian_entry(const T* y, T scale, T inv_d, index_t a, index_t b) {
  const T centring = (a == b ? T(1) : T(0)) - inv_d;
  return scale * (centring - y[a] * y[b] * inv_d);
}

// H_i[a,lo,hi] for lo <= hi, with ga = gamma_a * (-1 / (d sigma_i^2)). Callers order (b, c) into
// (lo, hi), which makes H symmetric in (b, c) bit for bit.
template <class T>
BLOCKHESS_HD T hessian_entry(const T* y, T ga, T inv_d, index_t a, index_t lo, index_t hi) {
  const T pab = (a == lo ? T(1) : T(0)) - inv_d;
  const T pac = (a == hi ? T(1) : T(0)) - inv_d;
  const T pbc = (lo == hi ? T(1) : T(0)) - inv_d;
  return ga * (pab * y[hi] + pac * y[lo] + pbc * y[a] - T(3) * inv_d * y[a] * y[lo] * y[hi]);
}

// C_i[lo,hi] = sum_a g_a H_i[a,lo,hi] for lo <= hi, from p = Pc (g * gamma) at lo and hi,
// s = (g * gamma) . y and pref = -1 / (d sigma_i^2).
template <class T>
BLOCKHESS_HD T hessian_contract_entry(const T* y, T p_lo, T p_hi, T s, T pref, T inv_d, index_t lo, index_t hi) {
  const T pbc = (lo == hi ? T(1) : T(0)) - inv_d;
  return pref * (p_lo * y[hi] + y[lo] * p_hi + s * pbc - T(3) * inv_d * s * y[lo] * y[hi]);
}

// J_i for one row (d^2 entries), given y and sigma. gamma may be null (all ones).
template <class T>
BLOCKHESS_HD void jacobian_row(const T* y, T sigma, const T* gamma, index_t d, T* J) {
  const T inv_d = T(1) / static_cast<T>(d);
  for (index_t a = 0; a < d; ++a) {
    const T scale = (gamma ? gamma[a] : T(1)) / sigma;
    for (index_t b = 0; b < d; ++b) J[a * d + b] = jacobian_entry(y, scale, inv_d, a, b);
  }
}

// H_i[a,b,c] for one row (d^3 entries).
template <class T>
BLOCKHESS_HD void hessian_row(const T* y, T sigma, const T* gamma, index_t d, T* H) {
  const T inv_d = T(1) / static_cast<T>(d);
  const T pref = -inv_d / sigma / sigma;  // never sigma^2: it under- or overflows first
  for (index_t a = 0; a < d; ++a) {
    const T ga = (gamma ? gamma[a] : T(1)) * pref;
    for (index_t b = 0; b < d; ++b) {
      for (index_t c = b; c < d; ++c) {
        const T v = hessian_entry(y, ga, inv_d, a, b, c);
        H[(a * d + b) * d + c] = v;
        H[(a * d + c) * d + b] = v;
      }
    }
  }
}

// C[b,c] = sum_a g_a H_i[a,b,c] for one row: the second derivative contracted with a cotangent g.
template <class T>
BLOCKHESS_HD void hessian_contract_row(const T* y, T sigma, const T* gamma, const T* g, index_t d, T* C) {
  const T inv_d = T(1) / static_cast<T>(d);
  // g' = g * gamma;  p = Pc g';  s = g' . y
  T gsum = 0, s = 0;
  for (index_t a = 0; a < d; ++a) {
    const T ga = g[a] * (gamma ? gamma[a] : T(1));
    gsum += ga;
    s += ga * y[a];
  }
  const T gmean = gsum * inv_d;
  const T pref = -inv_d / sigma / sigma;  // never sigma^2: it under- or overflows first
  for (index_t b = 0; b < d; ++b) {
    const T pb = g[b] * (gamma ? gamma[b] : T(1)) - gmean;
    for (index_t c = b; c < d; ++c) {
      const T pc = g[c] * (gamma ? gamma[c] : T(1)) - gmean;
      const T v = hessian_contract_entry(y, pb, pc, s, pref, inv_d, b, c);
      C[b * d + c] = v;
      C[c * d + b] = v;
    }
  }
}

// Vector-Jacobian product of one row without affine parameters: u = J^T g = (g - mean(g) - y mean(y g)) / sigma.
// J is symmetric, so this is also the Jacobian-vector product (the row's tangent for an input tangent g).
template <class T>
BLOCKHESS_HD void vjp_row(const T* y, T sigma, const T* g, index_t d, T* u) {
  T mean = 0, yg = 0;
  for (index_t a = 0; a < d; ++a) mean += g[a], yg += y[a] * g[a];
  mean /= static_cast<T>(d);
  yg /= static_cast<T>(d);
  for (index_t a = 0; a < d; ++a) u[a] = (g[a] - mean - y[a] * yg) / sigma;
}

// Tangent of u = vjp_row(y, sigma, g) with g fixed while the row's input moves by ds, its output
// by dy = J ds (sigma moves by mean(y ds)): the LayerNorm curvature in a Hessian-vector product,
// sum_a g_a H[a,:,:] ds in O(d) instead of the d x d contraction.
//   du = -(mean(y g) dy + mean(dy g) y + mean(y ds) u) / sigma
template <class T>
BLOCKHESS_HD void vjp_tangent_row(const T* y, T sigma, const T* g, const T* u, const T* ds, const T* dy, index_t d,
                                  T* du) {
  T yg = 0, dyg = 0, yds = 0;
  for (index_t a = 0; a < d; ++a) yg += y[a] * g[a], dyg += dy[a] * g[a], yds += y[a] * ds[a];
  const T inv_d = T(1) / static_cast<T>(d);
  yg *= inv_d, dyg *= inv_d, yds *= inv_d;
  for (index_t a = 0; a < d; ++a) du[a] = -(yg * dy[a] + dyg * y[a] + yds * u[a]) / sigma;
}

namespace detail {
inline void check_shape(index_t L, index_t d) {
  if (L < 1 || d < 1)
    throw std::invalid_argument("layernorm: X must have shape (L, d) with L >= 1 and d >= 1, got (" +
                                std::to_string(L) + ", " + std::to_string(d) + ")");
}
// Called after a parallel loop (exceptions must not leave an OpenMP region).
template <class T>
void check_sigmas(const T* sigma, index_t L) {
  for (index_t i = 0; i < L; ++i)
    if (!(sigma[i] > T(0)))
      throw std::domain_error("layernorm: row " + std::to_string(i) +
                              " has zero variance (it is constant up to rounding at its scale); pass eps > 0 "
                              "to make LayerNorm differentiable there");
}
}  // namespace detail

// Z = LN(X) for X of shape (L, d); gamma and beta may be null. sigma (L) is scratch.
template <class T>
void forward(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* beta, T* Z, T* sigma,
             FiniteRecord* record = nullptr) {
  detail::check_shape(L, d);
  blockhess::detail::parallel_for(L, d, [&](index_t i) {
    T* z = Z + i * d;
    sigma[i] = normalize_row(X + i * d, d, eps, z);
    for (index_t a = 0; a < d; ++a) z[a] = (gamma ? gamma[a] : T(1)) * z[a] + (beta ? beta[a] : T(0));
    note_finite(record, z, d);
  });
  detail::check_sigmas(sigma, L);
}

// Per-row buffers: y (L, d) and sigma (L). Used by the derivative entry points below.
template <class T>
void normalize(const T* X, index_t L, index_t d, T eps, T* y, T* sigma) {
  detail::check_shape(L, d);
  blockhess::detail::parallel_for(L, d, [&](index_t i) { sigma[i] = normalize_row(X + i * d, d, eps, y + i * d); });
  detail::check_sigmas(sigma, L);
}

// Whether every Jacobian entry is finite without looking at them: |J_ab| = |gamma_a| / sigma
// |delta_ab - 1/d - y_a y_b / d| < 3 |gamma_a| / sigma, since |y_a y_b| <= |y|^2 = d. When this
// bound is far inside the float range the per-entry check (a pass as long as the writing) is skipped.
template <class T>
bool jacobian_certainly_finite(const T* sigma, const T* gamma, index_t L, index_t d) {
  T largest_gamma = gamma ? T(0) : T(1), smallest_sigma = sigma[0];
  if (gamma)
    for (index_t a = 0; a < d; ++a) largest_gamma = std::max(largest_gamma, std::abs(gamma[a]));
  for (index_t i = 1; i < L; ++i) smallest_sigma = std::min(smallest_sigma, sigma[i]);
  const T bound = T(4) * (largest_gamma / smallest_sigma);
  return bound < std::numeric_limits<T>::max() / T(4);
}

// Jacobian blocks (L, d, d); y and sigma from normalize().
template <class T>
void jacobian_blocks(const T* y, const T* sigma, const T* gamma, index_t L, index_t d, T* J,
                     FiniteRecord* record = nullptr) {
  blockhess::detail::parallel_for(L, d * d, [&](index_t i) {
    jacobian_row(y + i * d, sigma[i], gamma, d, J + i * d * d);
    note_finite(record, J + i * d * d, d * d);
  });
}

// Dense Jacobian (L d, L d): the row blocks on the diagonal, zeros elsewhere.
template <class T>
void jacobian_dense(const T* y, const T* sigma, const T* gamma, index_t L, index_t d, T* J,
                    FiniteRecord* record = nullptr) {
  const index_t n = L * d;
  blockhess::detail::parallel_for(L, n * d, [&](index_t i) {
    T* rows = J + i * d * n;
    std::memset(rows, 0, sizeof(T) * static_cast<size_t>(d * n));
    const T* yi = y + i * d;
    const T inv_d = T(1) / static_cast<T>(d);
    for (index_t a = 0; a < d; ++a) {
      const T scale = (gamma ? gamma[a] : T(1)) / sigma[i];
      T* row = rows + a * n + i * d;
      for (index_t b = 0; b < d; ++b)
        row[b] = scale * ((a == b ? T(1) : T(0)) - inv_d - yi[a] * yi[b] * inv_d);
      note_finite(record, row, d);  // the zeros around the block are finite
    }
  });
}

// Second-derivative blocks (L, d, d, d).
template <class T>
void hessian_blocks(const T* y, const T* sigma, const T* gamma, index_t L, index_t d, T* H,
                    FiniteRecord* record = nullptr) {
  blockhess::detail::parallel_for(L, d * d * d, [&](index_t i) {
    hessian_row(y + i * d, sigma[i], gamma, d, H + i * d * d * d);
    note_finite(record, H + i * d * d * d, d * d * d);
  });
}

// Dense second derivative ((L d)^2, L d) in the paper's layout: entry [(o*n + p), q] = d2 Z_o / dx_p dx_q.
template <class T>
void hessian_dense(const T* y, const T* sigma, const T* gamma, index_t L, index_t d, T* H, T* scratch_d3,
                   FiniteRecord* record = nullptr) {
  const index_t n = L * d;
  std::memset(H, 0, sizeof(T) * static_cast<size_t>(n * n * n));
  for (index_t i = 0; i < L; ++i) {
    hessian_row(y + i * d, sigma[i], gamma, d, scratch_d3);
    note_finite(record, scratch_d3, d * d * d);  // the nonzero entries, before they are spread out
    for (index_t a = 0; a < d; ++a)
      for (index_t b = 0; b < d; ++b) {
        const index_t o = i * d + a, p = i * d + b;
        T* row = H + (o * n + p) * n + i * d;
        std::memcpy(row, scratch_d3 + (a * d + b) * d, sizeof(T) * static_cast<size_t>(d));
      }
  }
}

// Contraction with an output cotangent G (L, d): C (L, d, d), C_i = sum_a G_ia H_i[a].
template <class T>
void hessian_contract(const T* y, const T* sigma, const T* gamma, const T* G, index_t L, index_t d, T* C,
                      FiniteRecord* record = nullptr) {
  blockhess::detail::parallel_for(L, d * d, [&](index_t i) {
    hessian_contract_row(y + i * d, sigma[i], gamma, G + i * d, d, C + i * d * d);
    note_finite(record, C + i * d * d, d * d);
  });
}

// dZ/dgamma (L d, d): [i d + a, c] = delta_ac y_ia.   dZ/dbeta (L d, d): [i d + a, c] = delta_ac.
template <class T>
void jacobian_gamma(const T* y, index_t L, index_t d, T* out) {
  std::memset(out, 0, sizeof(T) * static_cast<size_t>(L * d * d));
  for (index_t i = 0; i < L; ++i)
    for (index_t a = 0; a < d; ++a) out[(i * d + a) * d + a] = y[i * d + a];
}
template <class T>
void jacobian_beta(index_t L, index_t d, T* out) {
  std::memset(out, 0, sizeof(T) * static_cast<size_t>(L * d * d));
  for (index_t i = 0; i < L; ++i)
    for (index_t a = 0; a < d; ++a) out[(i * d + a) * d + a] = T(1);
}

}  // namespace blockhess::layernorm
