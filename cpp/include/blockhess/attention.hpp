// Single-head self-attention and its exact Jacobians (docs/derivation.md §2.1, §3.3; Noci et al. Lemma A.2).
//
//   Q = X W_Q, K = X W_K, V = X W_V,  T = Q K^T / sqrt(d_k),  A = softmax_row(T),  F = A V.
//   X (L, d), W_Q and W_K (d, d_k), W_V (d, d_v); F (L, d_v). Row t of X is x_t, of Q is q_t.
//
// Jacobians in the vec_r numerator layout, row t d_v + a (output F[t,a]), with c = 1/sqrt(d_k).
// dA[t,s] = A[t,s] (dT[t,s] - sum_u A[t,u] dT[t,u]) makes every softmax term a *centred* sum, which
// is what we compute (never D_A, E_Q, E_K or a commutation matrix):
//   dF[t,a]/dW_Q[b,k] = c x_t[b] sum_s A[t,s] V[s,a] (K[s,k] - Kbar_t[k]),   Kbar = A K
//   dF[t,a]/dW_K[b,k] = c q_t[k] sum_s A[t,s] V[s,a] (X[s,b] - Xbar_t[b]),   Xbar = A X
//   dF[t,a]/dW_V[b,e] = (A X)[t,b] delta_ae
//   dF[t,a]/dX[u,b]   = A[t,u] (W_V[b,a] + c (V[u,a] - F[t,a]) (Q W_K^T)[t,b])
//                       + delta_tu c sum_s A[t,s] (V[s,a] - F[t,a]) (K W_Q^T)[s,b]
// The last line: X enters V, and T twice (dT[t,s]/dx_u = delta_tu W_Q k_s + delta_su W_K q_t, times c).
// These agree with the paper's G_Q, G_K (with K_{d_K,d_V}, erratum E10) and G_V.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/eigen.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::attention {

enum class Wrt { W_Q = 0, W_K = 1, W_V = 2, X = 3 };

struct Dims {
  index_t L, d, dk, dv;
  // Columns of the Jacobian with respect to `wrt`.
  index_t n_wrt(Wrt wrt) const {
    switch (wrt) {
      case Wrt::W_Q:
      case Wrt::W_K: return d * dk;
      case Wrt::W_V: return d * dv;
      case Wrt::X: return L * d;
    }
    return 0;
  }
};

inline void check_dims(const Dims& s) {
  if (s.L < 1 || s.d < 1 || s.dk < 1 || s.dv < 1)
    throw std::invalid_argument("attention: need L, d, d_k, d_v >= 1, got L=" + std::to_string(s.L) +
                                ", d=" + std::to_string(s.d) + ", d_k=" + std::to_string(s.dk) +
                                ", d_v=" + std::to_string(s.dv));
}

// The forward quantities every derivative reuses (row-major), with aligned copies of the inputs:
// every Eigen product reads those, so results never depend on where the caller's arrays live.
template <class T>
struct Cache {
  Dims dims;
  T c;                           // 1 / sqrt(d_k)
  Buffer<T> X, WQ, WK, WV;       // the inputs
  Buffer<T> Q, K, V;             // (L, d_k), (L, d_k), (L, d_v)
  Buffer<T> A, F;                // (L, L), (L, d_v)
};

namespace detail {

inline size_t sz(index_t n) { return static_cast<size_t>(n); }
}  // namespace detail

template <class T>
Cache<T> forward_cache(const T* X, const T* WQ, const T* WK, const T* WV, const Dims& s) {
  check_dims(s);
  using detail::sz;
  Cache<T> f{s,
             T(1) / std::sqrt(static_cast<T>(s.dk)),
             aligned_copy(X, s.L * s.d),
             aligned_copy(WQ, s.d * s.dk),
             aligned_copy(WK, s.d * s.dk),
             aligned_copy(WV, s.d * s.dv),
             Buffer<T>(sz(s.L * s.dk)),
             Buffer<T>(sz(s.L * s.dk)),
             Buffer<T>(sz(s.L * s.dv)),
             Buffer<T>(sz(s.L * s.L)),
             Buffer<T>(sz(s.L * s.dv))};
  MapC<T> x(f.X.data(), s.L, s.d);
  MapM<T> q(f.Q.data(), s.L, s.dk), k(f.K.data(), s.L, s.dk), v(f.V.data(), s.L, s.dv);
  q.noalias() = x * MapC<T>(f.WQ.data(), s.d, s.dk);
  k.noalias() = x * MapC<T>(f.WK.data(), s.d, s.dk);
  v.noalias() = x * MapC<T>(f.WV.data(), s.d, s.dv);
  Buffer<T> logits(sz(s.L * s.L));
  MapM<T>(logits.data(), s.L, s.L).noalias() = f.c * (q * k.transpose());
  softmax::forward(logits.data(), s.L, s.L, f.A.data());
  MapM<T>(f.F.data(), s.L, s.dv).noalias() = MapM<T>(f.A.data(), s.L, s.L) * v;
  return f;
}

// F = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V, F (L, d_v).
template <class T>
void forward(const T* X, const T* WQ, const T* WK, const T* WV, const Dims& s, T* F) {
  const auto f = forward_cache(X, WQ, WK, WV, s);
  std::memcpy(F, f.F.data(), sizeof(T) * detail::sz(s.L * s.dv));
}

// J (L d_v, d d_k) = dF / dW_Q.
template <class T>
void jacobian_wq(const Cache<T>& f, T* J, FiniteRecord* record = nullptr) {
  const index_t L = f.dims.L, d = f.dims.d, dk = f.dims.dk, dv = f.dims.dv;
  const index_t n = d * dk;
  const T* X = f.X.data();
  Buffer<T> Kbar(detail::sz(L * dk)), M(detail::sz(L * dv * dk));
  MapM<T>(Kbar.data(), L, dk).noalias() =
      MapC<T>(f.A.data(), L, L) * MapC<T>(f.K.data(), L, dk);
  blockhess::detail::parallel_for(L, L * dv * dk + dv * n, [&](index_t t) {
    // M_t[a,k] = sum_s A[t,s] V[s,a] (K[s,k] - Kbar_t[k])
    T* Mt = M.data() + t * dv * dk;
    const T* kbar = Kbar.data() + t * dk;
    std::fill(Mt, Mt + dv * dk, T(0));
    for (index_t s = 0; s < L; ++s) {
      const T w = f.A[t * L + s];
      const T* ks = f.K.data() + s * dk;
      for (index_t a = 0; a < dv; ++a) {
        const T wv = w * f.V[s * dv + a];
        T* row = Mt + a * dk;
        for (index_t k = 0; k < dk; ++k) row[k] += wv * (ks[k] - kbar[k]);
      }
    }
    // J[t d_v + a, b d_k + k] = c x_t[b] M_t[a,k]
    const T* xt = X + t * d;
    for (index_t a = 0; a < dv; ++a) {
      T* row = J + (t * dv + a) * n;
      for (index_t b = 0; b < d; ++b) {
        const T xb = f.c * xt[b];
        for (index_t k = 0; k < dk; ++k) row[b * dk + k] = xb * Mt[a * dk + k];
      }
    }
    note_finite(record, J + t * dv * n, dv * n);
  });
}

// J (L d_v, d d_k) = dF / dW_K.
template <class T>
void jacobian_wk(const Cache<T>& f, T* J, FiniteRecord* record = nullptr) {
  const index_t L = f.dims.L, d = f.dims.d, dk = f.dims.dk, dv = f.dims.dv;
  const index_t n = d * dk;
  const T* X = f.X.data();
  Buffer<T> Xbar(detail::sz(L * d)), N(detail::sz(L * dv * d));
  MapM<T>(Xbar.data(), L, d).noalias() = MapC<T>(f.A.data(), L, L) * MapC<T>(X, L, d);
  blockhess::detail::parallel_for(L, L * dv * d + dv * n, [&](index_t t) {
    // N_t[a,b] = sum_s A[t,s] V[s,a] (X[s,b] - Xbar_t[b])
    T* Nt = N.data() + t * dv * d;
    const T* xbar = Xbar.data() + t * d;
    std::fill(Nt, Nt + dv * d, T(0));
    for (index_t s = 0; s < L; ++s) {
      const T w = f.A[t * L + s];
      const T* xs = X + s * d;
      for (index_t a = 0; a < dv; ++a) {
        const T wv = w * f.V[s * dv + a];
        T* row = Nt + a * d;
        for (index_t b = 0; b < d; ++b) row[b] += wv * (xs[b] - xbar[b]);
      }
    }
    // J[t d_v + a, b d_k + k] = c q_t[k] N_t[a,b]
    const T* qt = f.Q.data() + t * dk;
    for (index_t a = 0; a < dv; ++a) {
      T* row = J + (t * dv + a) * n;
      for (index_t b = 0; b < d; ++b) {
        const T nb = f.c * Nt[a * d + b];
        for (index_t k = 0; k < dk; ++k) row[b * dk + k] = nb * qt[k];
      }
    }
    note_finite(record, J + t * dv * n, dv * n);
  });
}

// J (L d_v, d d_v) = dF / dW_V = (A X) (x) I_{d_v}.
template <class T>
void jacobian_wv(const Cache<T>& f, T* J) {
  const index_t L = f.dims.L, d = f.dims.d, dv = f.dims.dv;
  const index_t n = d * dv;
  const T* X = f.X.data();
  Buffer<T> AX(detail::sz(L * d));
  MapM<T>(AX.data(), L, d).noalias() = MapC<T>(f.A.data(), L, L) * MapC<T>(X, L, d);
  blockhess::detail::parallel_for(L, dv * n, [&](index_t t) {
    T* rows = J + t * dv * n;
    std::memset(rows, 0, sizeof(T) * detail::sz(dv * n));
    for (index_t a = 0; a < dv; ++a)
      for (index_t b = 0; b < d; ++b) rows[a * n + b * dv + a] = AX[t * d + b];
  });
}

// J (L d_v, L d) = dF / dX.
template <class T>
void jacobian_x(const Cache<T>& f, T* J, FiniteRecord* record = nullptr) {
  const index_t L = f.dims.L, d = f.dims.d, dk = f.dims.dk, dv = f.dims.dv;
  const index_t n = L * d;
  const T *WQ = f.WQ.data(), *WK = f.WK.data(), *WV = f.WV.data();
  // Qt = Q W_K^T (row t is W_K q_t), Kt = K W_Q^T (row s is W_Q k_s); both (L, d).
  Buffer<T> Qt(detail::sz(L * d)), Kt(detail::sz(L * d));
  MapM<T>(Qt.data(), L, d).noalias() =
      MapC<T>(f.Q.data(), L, dk) * MapC<T>(WK, d, dk).transpose();
  MapM<T>(Kt.data(), L, d).noalias() =
      MapC<T>(f.K.data(), L, dk) * MapC<T>(WQ, d, dk).transpose();
  blockhess::detail::parallel_for(L, 2 * dv * n, [&](index_t t) {
    const T* at = f.A.data() + t * L;
    const T* qt = Qt.data() + t * d;
    for (index_t a = 0; a < dv; ++a) {
      T* row = J + (t * dv + a) * n;
      const T fa = f.F[t * dv + a];
      // Through V and through the key side of T: A[t,u] (W_V[b,a] + c (V[u,a] - F[t,a]) Qt[t,b]).
      for (index_t u = 0; u < L; ++u) {
        const T w = at[u];
        const T g = f.c * w * (f.V[u * dv + a] - fa);
        T* blk = row + u * d;
        for (index_t b = 0; b < d; ++b) blk[b] = w * WV[b * dv + a] + g * qt[b];
      }
      // Through the query side of T (u = t only): c sum_s A[t,s] (V[s,a] - F[t,a]) Kt[s,b].
      T* diag = row + t * d;
      for (index_t s = 0; s < L; ++s) {
        const T g = f.c * at[s] * (f.V[s * dv + a] - fa);
        const T* ks = Kt.data() + s * d;
        for (index_t b = 0; b < d; ++b) diag[b] += g * ks[b];
      }
      note_finite(record, row, n);
    }
  });
}

// dF / d(wrt) into J of shape (L d_v, dims.n_wrt(wrt)). With a record, every entry is checked finite
// as it is written (dF/dW_V holds convex combinations of rows of X: always finite).
template <class T>
void jacobian(const T* X, const T* WQ, const T* WK, const T* WV, const Dims& s, Wrt wrt, T* J,
              FiniteRecord* record = nullptr) {
  const auto f = forward_cache(X, WQ, WK, WV, s);
  switch (wrt) {
    case Wrt::W_Q: jacobian_wq(f, J, record); break;
    case Wrt::W_K: jacobian_wk(f, J, record); break;
    case Wrt::W_V: jacobian_wv(f, J); break;
    case Wrt::X: jacobian_x(f, J, record); break;
    default: throw std::invalid_argument("attention::jacobian: unknown wrt");
  }
}

}  // namespace blockhess::attention
