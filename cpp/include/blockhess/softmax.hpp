// Row softmax a = softmax(t) and its exact derivatives (Noci et al. Lemma A.2, Ormaniec et al.
// Lemma C.1). Row i of A depends only on row i of T, so everything is stored per row:
//   Jacobian row block   J_i[j,k]   = a_j (delta_jk - a_k)
//   Hessian  row block   H_i[j,k,l] = a_j (2 a_k a_l + delta_jk delta_jl - delta_kl a_k
//                                          - delta_jk a_l - delta_jl a_k)
#pragma once

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::softmax {

// a = softmax(t) for one row of length n (max-shifted, so it never overflows); returns max_k t_k and
// sets total = sum_k exp(t_k - max t), which is >= 1 (the largest entry's exp(0)). a may alias t.
template <class T>
BLOCKHESS_HD T forward_row_shifted(const T* t, index_t n, T* a, T& total) {
  T top = t[0];
  for (index_t k = 1; k < n; ++k) top = t[k] > top ? t[k] : top;
  total = 0;
  for (index_t k = 0; k < n; ++k) {
    a[k] = std::exp(t[k] - top);
    total += a[k];
  }
  const T inv = T(1) / total;
  for (index_t k = 0; k < n; ++k) a[k] *= inv;
  return top;
}

template <class T>
BLOCKHESS_HD void forward_row(const T* t, index_t n, T* a) {
  T total;
  forward_row_shifted(t, n, a, total);
}

// a = softmax(t) for one row, and the cross-entropy -log a_c of class c in log-sum-exp form,
// (max t - t_c) + log sum_k exp(t_k - max t): finite for every finite row, where -log a_c is
// -log 0 = Inf once a_c underflows (a gap past about 745 in float64, 104 in float32). a must not alias t.
template <class T>
BLOCKHESS_HD T cross_entropy_row(const T* t, index_t n, index_t c, T* a) {
  T total;
  const T top = forward_row_shifted(t, n, a, total);
  return (top - t[c]) + std::log(total);
}

// J_i[j,k] = a_j (delta_jk - a_k) for one row, from a = softmax(t); n^2 entries.
template <class T>
BLOCKHESS_HD void jacobian_row(const T* a, index_t n, T* J) {
  for (index_t j = 0; j < n; ++j)
    for (index_t k = 0; k < n; ++k) J[j * n + k] = a[j] * ((j == k ? T(1) : T(0)) - a[k]);
}

// One entry H_i[j,k,l] = d2 a_j / dt_k dt_l. The formula at the top of the file cancels badly
// (e.g. a_j (2 a_j^2 + 1 - 3 a_j) near a_j = 1/2), so it is evaluated in factored form per case:
//   j = k = l: a_j (1 - a_j) (1 - 2 a_j)        k = l != j: a_j a_k (2 a_k - 1)
//   j = k != l: a_j a_l (2 a_j - 1)             j = l != k: a_j a_k (2 a_j - 1)
//   all distinct: 2 a_j a_k a_l
// Symmetric in (k, l) bit for bit.
template <class T>
BLOCKHESS_HD T hessian_entry(const T* a, index_t j, index_t k, index_t l) {
  const T aj = a[j];
  if (k == l) return j == k ? aj * (T(1) - aj) * (T(1) - T(2) * aj) : aj * a[k] * (T(2) * a[k] - T(1));
  if (j == k) return aj * a[l] * (T(2) * aj - T(1));
  if (j == l) return aj * a[k] * (T(2) * aj - T(1));
  return T(2) * aj * (k < l ? a[k] * a[l] : a[l] * a[k]);
}

// H_i[j,k,l] for one row, from a = softmax(t); n^3 entries, symmetric in (k, l).
template <class T>
BLOCKHESS_HD void hessian_row(const T* a, index_t n, T* H) {
  for (index_t j = 0; j < n; ++j)
    for (index_t k = 0; k < n; ++k)
      for (index_t l = k; l < n; ++l) {
        const T v = hessian_entry(a, j, k, l);
        H[(j * n + k) * n + l] = v;
        H[(j * n + l) * n + k] = v;
      }
}

// C[k,l] = sum_j g_j H_i[j,k,l]: the Hessian of <g, softmax(t)> with respect to t, from a = softmax(t).
//   C = diag(w) - a w^T - w a^T,  with  w = a * (g - a.g).
// Symmetric by construction (both triangles are written from one value).
template <class T>
BLOCKHESS_HD void hessian_contract_row(const T* a, const T* g, index_t n, T* C) {
  T ag = 0;
  for (index_t k = 0; k < n; ++k) ag += a[k] * g[k];
  for (index_t k = 0; k < n; ++k) {
    const T wk = a[k] * (g[k] - ag);
    for (index_t l = k; l < n; ++l) {
      const T wl = a[l] * (g[l] - ag);
      const T v = (k == l ? wk : T(0)) - a[k] * wl - wk * a[l];
      C[k * n + l] = v;
      C[l * n + k] = v;
    }
  }
}

// Vector-Jacobian product for one row: gt = J_i^T g = a * (g - a.g), g and gt `stride` apart (a
// column of a matrix: J_i is symmetric, so this is J_i g too).
template <class T>
BLOCKHESS_HD void vjp_row(const T* a, const T* g, index_t n, T* gt, index_t stride = 1) {
  T ag = 0;
  for (index_t k = 0; k < n; ++k) ag += a[k] * g[k * stride];
  for (index_t k = 0; k < n; ++k) gt[k * stride] = a[k] * (g[k * stride] - ag);
}

// Tangent of vjp_row as the row moves: the derivative of gt = a * (g - a.g) when a moves by da
// and g by dg (da = J_i dt, the softmax's own tangent). The Hessian-vector product's reverse pass.
//   dgt = da * (g - a.g) + a * (dg - da.g - a.dg)
template <class T>
BLOCKHESS_HD void vjp_tangent_row(const T* a, const T* da, const T* g, const T* dg, index_t n, T* dgt) {
  T ag = 0, dag = 0, adg = 0;
  for (index_t k = 0; k < n; ++k) ag += a[k] * g[k], dag += da[k] * g[k], adg += a[k] * dg[k];
  for (index_t k = 0; k < n; ++k) dgt[k] = da[k] * (g[k] - ag) + a[k] * (dg[k] - dag - adg);
}

// ---- Whole matrices: T (m, n), softmax over each of the m rows. ----

namespace detail {
inline void check_shape(index_t m, index_t n) {
  if (m < 1 || n < 1)
    throw std::invalid_argument("softmax: T must have shape (m, n) with m, n >= 1, got (" + std::to_string(m) +
                                ", " + std::to_string(n) + ")");
}
}  // namespace detail

// A = softmax(T) row by row; A (m, n).
template <class T>
void forward(const T* Tm, index_t m, index_t n, T* A) {
  detail::check_shape(m, n);
  blockhess::detail::parallel_for(m, n, [&](index_t i) { forward_row(Tm + i * n, n, A + i * n); });
}

// Jacobian blocks (m, n, n) from A = softmax(T): block i is J_i.
template <class T>
void jacobian_blocks(const T* A, index_t m, index_t n, T* J) {
  detail::check_shape(m, n);
  blockhess::detail::parallel_for(m, n * n, [&](index_t i) { jacobian_row(A + i * n, n, J + i * n * n); });
}

// Dense Jacobian (m n, m n): the row blocks on the diagonal, zeros elsewhere.
template <class T>
void jacobian_dense(const T* A, index_t m, index_t n, T* J) {
  detail::check_shape(m, n);
  const index_t N = m * n;
  blockhess::detail::parallel_for(m, n * N, [&](index_t i) {
    T* rows = J + i * n * N;
    std::memset(rows, 0, sizeof(T) * static_cast<size_t>(n * N));
    const T* a = A + i * n;
    for (index_t j = 0; j < n; ++j)
      for (index_t k = 0; k < n; ++k) rows[j * N + i * n + k] = a[j] * ((j == k ? T(1) : T(0)) - a[k]);
  });
}

// Second-derivative blocks (m, n, n, n): [i, j, k, l] = d2 A_ij / dT_ik dT_il.
template <class T>
void hessian_blocks(const T* A, index_t m, index_t n, T* H) {
  detail::check_shape(m, n);
  blockhess::detail::parallel_for(m, n * n * n, [&](index_t i) { hessian_row(A + i * n, n, H + i * n * n * n); });
}

// Dense second derivative ((m n)^2, m n) in the paper's layout: [(o N + p), q] = d2 A_o / dT_p dT_q,
// N = m n. Only o, p, q in the same row are nonzero; row i's block is written straight into place.
template <class T>
void hessian_dense(const T* A, index_t m, index_t n, T* H) {
  detail::check_shape(m, n);
  const index_t N = m * n;
  // Rows (o, p) with o in row i form the contiguous slab [i n N, (i+1) n N) of N-wide rows.
  blockhess::detail::parallel_for(m, n * N * N, [&](index_t i) {
    T* slab = H + i * n * N * N;
    std::memset(slab, 0, sizeof(T) * static_cast<size_t>(n * N * N));
    const T* a = A + i * n;
    // o = i n + j, p = i n + k, q = i n + l; local row (o - i n) N + p within the slab.
    for (index_t j = 0; j < n; ++j)
      for (index_t k = 0; k < n; ++k)
        for (index_t l = k; l < n; ++l) {
          const T v = hessian_entry(a, j, k, l);
          slab[(j * N + i * n + k) * N + i * n + l] = v;
          slab[(j * N + i * n + l) * N + i * n + k] = v;
        }
  });
}

}  // namespace blockhess::softmax
