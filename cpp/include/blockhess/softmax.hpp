// Row softmax a = softmax(t) and its exact derivatives (Noci et al. Lemma A.2, Ormaniec et al.
// Lemma C.1). Row i of A depends only on row i of T, so everything is stored per row:
//   Jacobian row block   J_i[j,k]   = a_j (delta_jk - a_k)
//   Hessian  row block   H_i[j,k,l] = a_j (2 a_k a_l + delta_jk delta_jl - delta_kl a_k
//                                          - delta_jk a_l - delta_jl a_k)
#pragma once

#include <cmath>

#include "blockhess/config.hpp"

namespace blockhess::softmax {

// a = softmax(t) for one row of length n (max-shifted, so it never overflows).
template <class T>
BLOCKHESS_HD void forward_row(const T* t, index_t n, T* a) {
  T top = t[0];
  for (index_t k = 1; k < n; ++k) top = t[k] > top ? t[k] : top;
  T total = 0;
  for (index_t k = 0; k < n; ++k) {
    a[k] = std::exp(t[k] - top);
    total += a[k];
  }
  const T inv = T(1) / total;
  for (index_t k = 0; k < n; ++k) a[k] *= inv;
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

// Vector-Jacobian product for one row: gt = J_i^T g = a * (g - a.g).
template <class T>
BLOCKHESS_HD void vjp_row(const T* a, const T* g, index_t n, T* gt) {
  T ag = 0;
  for (index_t k = 0; k < n; ++k) ag += a[k] * g[k];
  for (index_t k = 0; k < n; ++k) gt[k] = a[k] * (g[k] - ag);
}

}  // namespace blockhess::softmax
