// Structured assembly on the GPU: commutation matrices, per-token Kronecker sums (the blocks of the
// block Hessian), mirroring of symmetric matrices. Plain C++ launchers, no CUDA types.
//
// Device pointers to C-contiguous row-major arrays; asynchronous on `stream`; std::runtime_error on
// a CUDA error, std::invalid_argument on bad sizes. Large matrix products are not done here (the
// Python layer uses cuBLAS through CuPy for those).
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"

namespace blockhess::cuda {

// How a parameter matrix of shape (n_first, n_second) splits into a "vector" index o (carried by a
// per-token vector) and a "matrix" index r (carried by a per-token matrix); as kron::Split on the CPU.
// The matrix may be a block of columns of a wider parameter (one attention head's): its rows are
// then `stride` apart and its first column is column `offset` (stride 0: n_second, the whole one).
struct Split {
  index_t n_first = 0, n_second = 0;
  bool vec_on_first = true;
  index_t stride = 0, offset = 0;
};

namespace assembly {

// out = K_{m,n} v: v and out have m n rows of `cols` entries; row i n + j of out is row j m + i of v.
template <class T>
void commute(const T* v, index_t m, index_t n, index_t cols, T* out, std::uintptr_t stream);

// Dense K_{m,n} (m n, m n).
template <class T>
void commutation_dense(index_t m, index_t n, T* K, std::uintptr_t stream);

// Per-token Kronecker sum into a block of a larger matrix (row stride ldH):
//   H[flat_i(oi, ri), flat_j(oj, rj)] += alpha * sum_t u[t, oi] w[t, oj] Gamma[t, ri, rj]
// u (tokens, n_vec_i), w (tokens, n_vec_j), Gamma (tokens, n_mat_i, n_mat_j). With upper_only (a
// piece with itself: si == sj), only entries with column >= row are written: for diagonal blocks
// that mirror_upper completes afterwards.
template <class T>
void kron_accumulate(index_t tokens, Split si, const T* u, Split sj, const T* w, const T* Gamma, T alpha, T* H,
                     index_t ldH, bool upper_only, std::uintptr_t stream);

// The same sum when Gamma_t = diag(D_t): both splits share the matrix index r (n_mat_i == n_mat_j),
//   H[flat_i(oi, r), flat_j(oj, r)] += alpha * sum_t u[t, oi] w[t, oj] D[t, r],
// D (tokens, r), or nullptr for the identity. Entries off the shared r are left alone.
template <class T>
void kron_accumulate_diagonal(index_t tokens, Split si, const T* u, Split sj, const T* w, const T* D, T alpha, T* H,
                              index_t ldH, std::uintptr_t stream);
// H (n, n, row stride ld), entries with column >= row: += sum_k J[k, row] K[k, col], J and K (rows, n).
template <class T>
void gram_upper_accumulate(index_t rows, index_t n, const T* J, const T* K, T* H, index_t ld, std::uintptr_t stream);
// *flag (device memory, an unsigned int set to 0 beforehand) becomes nonzero if an entry of H
// (n, n, row stride ld) is Inf or NaN.
template <class T>
void flag_nonfinite(const T* H, index_t n, index_t ld, unsigned* flag, std::uintptr_t stream);
// H (n, n, row stride ld): copies the upper triangle onto the lower one, so H is symmetric bit for bit.
template <class T>
void mirror_upper(T* H, index_t n, index_t ld, std::uintptr_t stream);

}  // namespace assembly
}  // namespace blockhess::cuda
