// LayerNorm on the GPU: plain C++ launchers (no CUDA types), docs/derivation.md §3.1.
//
// Every pointer is a device pointer to a C-contiguous array; gamma, beta and sigma may be null.
// Every launcher is asynchronous on `stream` (a cudaStream_t passed as an integer; 0 = legacy
// default stream), checks cudaGetLastError() after its launch and throws std::runtime_error on a
// CUDA error or std::invalid_argument on bad sizes.
//
// Each kernel starts from X itself (one thread block per row and tile recomputes y_i and sigma_i in
// shared memory), so every call is a single launch. When `sigma` is not null it receives the row
// standard deviations (L): a zero there means a zero-variance row with eps = 0, whose outputs are
// not finite; the caller checks it (one reduction) and raises.
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"

namespace blockhess::cuda::layernorm {

// Z (L, d) = gamma * (X - mean) / sqrt(var + eps) + beta, row by row.
template <class T>
void forward(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* beta, T* Z, T* sigma,
             std::uintptr_t stream);

// What jacobian_blocks writes for token i (each a (d, d) slab, so the output is (L, d, d)):
enum class Slab : int {
  jacobian = 0,  // J_i[a,b] = gamma_a / sigma_i (delta_ab - 1/d - y_ia y_ib / d)
  gamma = 1,     // dZ_ia / dgamma_c = delta_ac y_ia   (the (L d, d) Jacobian wrt gamma)
  beta = 2,      // dZ_ia / dbeta_c  = delta_ac        (the (L d, d) Jacobian wrt beta)
};

// (L, d, d) slabs, written with coalesced stores by several thread blocks per row. tile_elems is the
// number of outputs one thread block writes (0 = the default, 4096); a tuning knob only.
template <class T>
void jacobian_blocks(const T* X, index_t L, index_t d, T eps, const T* gamma, Slab kind, T* out, T* sigma,
                     std::uintptr_t stream, index_t tile_elems = 0);

// Dense Jacobian (L d, L d): the blocks on the diagonal and zeros elsewhere, in one pass.
template <class T>
void jacobian_dense(const T* X, index_t L, index_t d, T eps, const T* gamma, T* J, T* sigma, std::uintptr_t stream);

// Second-derivative blocks (L, d, d, d): [i, a, b, c] = d2 Z_ia / dX_ib dX_ic, symmetric in (b, c)
// bit for bit (both entries are evaluated from the same ordered pair).
template <class T>
void hessian_blocks(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma, std::uintptr_t stream);

// Dense second derivative ((L d)^2, L d) in the paper's layout: [(o n + p), q], n = L d.
template <class T>
void hessian_dense(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma, std::uintptr_t stream);

// C (L, d, d): C_i = sum_a G_ia H_i[a], the second derivative contracted with the cotangent G (L, d).
template <class T>
void hessian_contract(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* G, T* C, T* sigma,
                      std::uintptr_t stream);

}  // namespace blockhess::cuda::layernorm
