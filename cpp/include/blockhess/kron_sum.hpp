// The one assembly primitive behind every block of the Transformer-block Hessian.
//
// Inside a block every parameter's derivative factorises per token t into a vector on one of the
// parameter's two matrix indices and a small matrix on the other (docs/derivation.md §4.2: "sums over tokens of
// Kronecker products"). A block of the Hessian is therefore
//
//     H[(p1,q1), (p2,q2)] += scale * sum_t  u_t[o_i] * w_t[o_j] * Gamma_t[r_i, r_j]
//
// where for parameter i the "vector index" o_i is p1 or q1 and the "matrix index" r_i is the other
// one. Forming it as a dense J^T J would cost tokens * rows(J) * n_i * n_j; this costs
// tokens * n_i * n_j, done as GEMMs of (n_oj x tokens) by (tokens x r_i r_j), one per o_i.
#pragma once

#include <algorithm>
#include <functional>

#include "blockhess/config.hpp"

namespace blockhess::kron {

// How a parameter matrix of shape (n_first, n_second) is split into vector and matrix indices.
// The matrix may be a block of columns of a wider parameter (one attention head's columns): its
// rows are then `stride` apart and its first column is column `offset` of the parameter.
struct Split {
  index_t n_first = 0, n_second = 0;
  bool vec_on_first = true;
  index_t stride = 0, offset = 0;  // stride 0: n_second (the whole parameter)

  index_t n_vec() const { return vec_on_first ? n_first : n_second; }
  index_t n_mat() const { return vec_on_first ? n_second : n_first; }
  index_t size() const { return n_first * n_second; }
  index_t row_stride() const { return stride > 0 ? stride : n_second; }
  bool whole() const { return offset == 0 && row_stride() == n_second; }
  // Flat (row-major) parameter index of (vector index o, matrix index r).
  index_t flat(index_t o, index_t r) const {
    return (vec_on_first ? o * row_stride() + r : r * row_stride() + o) + offset;
  }
};

namespace detail {
// Tasks an accumulate is split into (fewer when the rows run out). Fixed, never the thread count:
// the split decides the GEMM shapes and with them the rounding of every entry.
constexpr index_t kTasks = 8;

// Tokens per chunk so that one chunk of Gamma stays near 32 MiB.
inline index_t chunk_tokens(index_t tokens, index_t gamma_size) {
  const index_t budget = index_t(1) << 22;
  return std::max<index_t>(1, std::min<index_t>(tokens, budget / std::max<index_t>(1, gamma_size)));
}
}  // namespace detail

// The sums below, compiled once per instruction-set level by the Python modules
// (kron_sum_impl.hpp: the definitions and their contracts).
//
// H (row stride ldH, already offset to the block's first entry) += scale * sum_t u_t (x) w_t (x)
// Gamma_t, with gamma(t, out) writing Gamma_t, (si.n_mat(), sj.n_mat()) row-major, for token t.
template <class T>
void accumulate(index_t tokens, const Split& si, const T* u, const Split& sj, const T* w,
                const std::function<void(index_t, T*)>& gamma, T scale, T* H, index_t ldH, bool upper_only = false,
                bool overwrite = false, bool threads = true);
// The same sum when Gamma_t = diag(D_t) (D: (tokens, r), or null for the identity).
template <class T>
void accumulate_diagonal(index_t tokens, const Split& si, const T* u, const Split& sj, const T* w, const T* D,
                         T scale, T* H, index_t ldH, bool threads = true);
// Copies the upper triangle of the n x n matrix H onto its lower triangle; whether H is finite.
template <class T>
bool mirror_upper(T* H, index_t n);

}  // namespace blockhess::kron

#ifndef BLOCKHESS_COMPILED
#include "blockhess/kron_sum_impl.hpp"
#endif
