// Row softmax on the GPU: plain C++ launchers (no CUDA types), docs/derivation.md §3.2.
//
// T (m, n) holds logits and A = softmax(T) row by row. The derivative launchers take A (compute it
// once with forward()). Device pointers to C-contiguous arrays; asynchronous on `stream`;
// std::runtime_error on a CUDA error, std::invalid_argument on bad sizes.
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"

namespace blockhess::cuda::softmax {

// A (m, n) = softmax(T) over each row (max-shifted).
template <class T>
void forward(const T* Tm, index_t m, index_t n, T* A, std::uintptr_t stream);

// Jacobian blocks (m, n, n): [i, j, k] = A_ij (delta_jk - A_ik).
template <class T>
void jacobian_blocks(const T* A, index_t m, index_t n, T* J, std::uintptr_t stream);

// Dense Jacobian (m n, m n): the blocks on the diagonal, zeros elsewhere.
template <class T>
void jacobian_dense(const T* A, index_t m, index_t n, T* J, std::uintptr_t stream);

// Second-derivative blocks (m, n, n, n): [i, j, k, l] = d2 A_ij / dT_ik dT_il (softmax::hessian_entry),
// symmetric in (k, l) bit for bit.
template <class T>
void hessian_blocks(const T* A, index_t m, index_t n, T* H, std::uintptr_t stream);

// Dense second derivative ((m n)^2, m n) in the paper's layout.
template <class T>
void hessian_dense(const T* A, index_t m, index_t n, T* H, std::uintptr_t stream);

// C (m, n, n): C_i = sum_j G_ij H_i[j] = diag(w) - a w^T - w a^T, w = a * (g - a.g)
// (softmax::hessian_contract_row), symmetric bit for bit.
template <class T>
void hessian_contract(const T* A, const T* G, index_t m, index_t n, T* C, std::uintptr_t stream);

// out (m, n): row i is J_i^T g_i = a * (g - a.g) (softmax::vjp_row).
template <class T>
void vjp(const T* A, const T* G, index_t m, index_t n, T* out, std::uintptr_t stream);

}  // namespace blockhess::cuda::softmax
