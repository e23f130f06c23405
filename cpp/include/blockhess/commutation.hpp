// Commutation matrices and Kronecker products in the row-major (vec_r) convention (docs/derivation.md §1).
//
//   K_{m,n} vec(A) = vec(A^T) for A (m, n);  explicitly (K_{m,n})_{i n + j, j m + i} = 1.
//   Hence vec_r(A^T) = K_{n,m} vec_r(A), and K_{n,m} K_{m,n} = I.
//   (A (x) B) vec_r(X) = vec_r(A X B^T)  for A (p, m), B (q, n), X (m, n).
// K is a permutation, so it is applied as an index map and only materialised when asked for.
#pragma once

#include <algorithm>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include <Eigen/Core>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::commutation {

// Column of the single 1 in row r of K_{m,n}: r = i n + j maps to j m + i.
BLOCKHESS_HD inline index_t source_index(index_t r, index_t m, index_t n) {
  const index_t i = r / n, j = r % n;
  return j * m + i;
}

namespace detail {
inline void check_dims(index_t m, index_t n) {
  if (m < 1 || n < 1)
    throw std::invalid_argument("commutation: m and n must be >= 1, got m=" + std::to_string(m) +
                                ", n=" + std::to_string(n));
}
}  // namespace detail

// perm (m n): (K_{m,n} v)[r] = v[perm[r]].
inline void permutation(index_t m, index_t n, std::int64_t* perm) {
  detail::check_dims(m, n);
  for (index_t r = 0; r < m * n; ++r) perm[r] = static_cast<std::int64_t>(source_index(r, m, n));
}

// Dense K_{m,n}, shape (m n, m n).
template <class T>
void dense(index_t m, index_t n, T* K) {
  detail::check_dims(m, n);
  const index_t N = m * n;
  blockhess::detail::parallel_for(N, N, [&](index_t r) {
    T* row = K + r * N;
    std::memset(row, 0, sizeof(T) * static_cast<size_t>(N));
    row[source_index(r, m, n)] = T(1);
  });
}

// out = K_{m,n} v, where v has m n rows of `cols` entries each (cols = 1 for a vector).
template <class T>
void apply(const T* v, index_t m, index_t n, index_t cols, T* out) {
  detail::check_dims(m, n);
  if (cols < 1) throw std::invalid_argument("commutation: cols must be >= 1");
  blockhess::detail::parallel_for(m * n, cols, [&](index_t r) {
    std::memcpy(out + r * cols, v + source_index(r, m, n) * cols, sizeof(T) * static_cast<size_t>(cols));
  });
}

// out (p q) = (A (x) B) vec_r(X) = vec_r(A X B^T), with A (p, m), B (q, n), X (m, n), all row-major.
// The Kronecker product is never formed: two GEMMs, cost O(p m n + p n q).
template <class T>
void kron_apply(const T* A, index_t p, index_t m, const T* B, index_t q, index_t n, const T* X, T* out) {
  if (p < 1 || m < 1 || q < 1 || n < 1)
    throw std::invalid_argument("kron_apply: every dimension must be >= 1");
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // Aligned copies in and out: the products' bits must not depend on where the caller's arrays live.
  const Buffer<T> ac = aligned_copy(A, p * m), bc = aligned_copy(B, q * n), xc = aligned_copy(X, m * n);
  Buffer<T> yc(static_cast<size_t>(p * q));
  Eigen::Map<const Mat> a(ac.data(), p, m), b(bc.data(), q, n), x(xc.data(), m, n);
  Eigen::Map<Mat> y(yc.data(), p, q);
  // Multiply in the cheaper order.
  if (p * n * (m + q) <= m * q * (n + p))
    y.noalias() = (a * x) * b.transpose();
  else
    y.noalias() = a * (x * b.transpose());
  std::copy(yc.begin(), yc.end(), out);
}

}  // namespace blockhess::commutation
