// The attention's per-token derivatives (engine/nodes/attention.hpp) as row operations
// (engine/row_ops.hpp): what its parameters' right factors Mq_t and Mk_t are formed from, a head's
// rows of the identity (its G_t), and its Jacobian with respect to its input in closed form
// (docs/derivation.md §3.3).
// Each computes what the host's per-token Eigen expressions did, entry by entry.
#pragma once

#include "blockhess/config.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::engine::rows {

// out_t = diag(a_t) V: the rows of V (L, `cols` of `stride`) weighted by each token's attention row
// a_t (tokens, L), the left operand of V^T diag(a_t) K. An item is a row (t, s) of out (tokens, L,
// cols).
template <class T>
struct WeightedRows {
  const T* a;
  const T* rows;
  T* out;
  index_t L, cols, stride;
  index_t cost() const { return cols; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t r = begin; r < end; ++r) {
      const T w = a[r];  // a_t[s] at t L + s
      const T* v = rows + (r % L) * stride;
      T* o = out + r * cols;
      for (index_t c = 0; c < cols; ++c) o[c] = w * v[c];
    }
  }
};

// G_t of head `head`: the (width, cols) rows of the identity at the head's columns, stored column
// by column (tokens, cols, width) as a dense factor keeps it. An item is an entry.
template <class T>
struct HeadRows {
  T* out;
  index_t width, cols, head;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = k % width == head * cols + (k / width) % cols ? T(1) : T(0);
  }
};

// out (tokens, cols) = scale * columns [first, first + cols) of x (tokens, stride): a head's
// columns, scaled (the queries s q_t that W_K's factor carries). An item is an entry.
template <class T>
struct ScaledColumns {
  const T* x;
  T* out;
  index_t cols, stride, first;
  T scale;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = scale * x[(k / cols) * stride + first + k % cols];
  }
};

// Rows of dF/dX for one sample and head (docs/derivation.md §3.3): J (L h d_v, L d), row
// t h d_v + a for the head's output columns a, column u d + e. With the head's weights A (L, L),
// V and F (L, h d_v rows), W_V (d, h d_v), Qt = Q_i W_K,i^T and Kt = K_i W_Q,i^T (L, d):
//   J[t, a; u, e] = A[t,u] (W_V[e,a] + s (V[u,a] - F[t,a]) Qt[t,e])
//                 + [u = t] s sum_r A[t,r] (V[r,a] - F[t,a]) Kt[r,e].
// An item is a row (t, a - head d_v); marks[t h d_v + a] is then 0, or one of the row's entries that
// is Inf or NaN: its finiteness, checked while it is in cache.
template <class T>
struct AttentionInputRows {
  const T* A;
  const T* V;
  const T* F;
  const T* WV;
  const T* Qt;
  const T* Kt;
  T* J;
  T* marks;
  index_t L, d, hv, dv, head;
  T s;
  index_t cost() const { return 2 * L * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    const index_t cols = L * d;
    for (index_t item = begin; item < end; ++item) {
      const index_t t = item / dv, a = head * dv + item % dv;
      const T* at = A + t * L;
      const T* qt = Qt + t * d;
      T* row = J + (t * hv + a) * cols;
      const T fa = F[t * hv + a];
      for (index_t u = 0; u < L; ++u) {  // through V and the key side of T
        const T w = at[u], c = s * w * (V[u * hv + a] - fa);
        T* block = row + u * d;
        for (index_t e = 0; e < d; ++e) block[e] = w * WV[e * hv + a] + c * qt[e];
      }
      T* own = row + t * d;  // through the query side of T: token t only
      for (index_t r = 0; r < L; ++r) {
        const T c = s * at[r] * (V[r * hv + a] - fa);
        const T* kr = Kt + r * d;
        for (index_t e = 0; e < d; ++e) own[e] += c * kr[e];
      }
      T& mark = marks[t * hv + a];
      mark = T(0);
      if (largest_exponent(row, cols) == kExponentMask<T>)  // rare: an error follows
        for (index_t k = 0; k < cols; ++k)
          if (largest_exponent(row + k, 1) == kExponentMask<T>) mark = row[k];
    }
  }
};

}  // namespace blockhess::engine::rows
