// The block's two sublayers as functions of their own, for one sample (row-major arrays):
//   attention  F = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V   X (L, d), W_Q, W_K (d, d_k), W_V (d, d_v)
//   FFN        F = relu(Y W_1) W_2                              Y (L, d), W_1 (d, f), W_2 (f, e)
// with their exact Jacobians and the FFN's (W_1, W_2) second derivative (docs/derivation.md §3.3-3.4).
// Each is a small graph of the engine's nodes (an attention node; linear, relu, linear), and every
// derivative is the engine's (engine/derivatives.hpp): the same mathematics as the block's.
//
// Jacobians are in the vec_r numerator layout: row t w + a is output entry F[t, a], column the
// flat index of the variable. A stage that overflows throws non_finite_error naming the result.
//
// This header declares; components_impl.hpp defines. Header-only use gets both; the Python
// modules compile them once (cpp/compiled/components.cpp, BLOCKHESS_COMPILED elsewhere).
#pragma once

#include <optional>

#include "blockhess/backend.hpp"
#include "blockhess/config.hpp"
#include "blockhess/cpu_backend.hpp"

namespace blockhess::components {

struct AttentionDims {
  index_t L, d, dk, dv;  // tokens, input width, query/key width, value width
};

// What an attention Jacobian is taken with respect to; its columns: d d_k (W_Q, W_K), d d_v
// (W_V), L d (X).
enum class AttentionWrt : int { W_Q = 0, W_K = 1, W_V = 2, X = 3 };

inline index_t columns(const AttentionDims& s, AttentionWrt wrt) {
  switch (wrt) {
    case AttentionWrt::W_Q:
    case AttentionWrt::W_K: return s.d * s.dk;
    case AttentionWrt::W_V: return s.d * s.dv;
    case AttentionWrt::X: return s.L * s.d;
  }
  return 0;
}

// F (L, d_v). Each function here runs on `backend`, whose memory holds every array (the host's by
// default).
template <class T>
void attention_forward(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s, T* F,
                       const Backend<T>& backend = cpu_backend<T>());
// J (L d_v, columns(s, wrt)) = dF / d(wrt).
template <class T>
void attention_jacobian(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s,
                        AttentionWrt wrt, T* J, const Backend<T>& backend = cpu_backend<T>());

struct FfnDims {
  index_t L, d, f, e;  // tokens, input width, hidden width d_ff, output width
};

// What ffn_jacobian writes. J = U (x) V per token: J[t e + c, p n + q] = U[t, p] V[t, c, q].
enum class FfnJacobian : int {
  W_1 = 0,         // dF/dW_1, (L e, d f)
  W_2 = 1,         // dF/dW_2, (L e, f e)
  Y = 2,           // dF/dY, (L e, L d): block diagonal (the FFN acts on each token alone)
  Y_blocks = 3,    // its diagonal blocks, (L, e, d)
  W_1_factor = 4,  // V of dF/dW_1: relu'(H_t) W_2 as (L, e, f) (U = Y)
  W_2_factor = 5,  // U of dF/dW_2: relu(Y W_1), (L, f) (V = I)
};

// What ffn_cross_hessian writes: d2 F[t,c] / dW_1[b,g] dW_2[g',c'] = delta_gg' delta_cc' Y[t,b] relu'(H[t,g]).
enum class FfnCross : int {
  blocks = 0,  // the values Y[t,b] relu'(H[t,g]), (L, d, f)
  dense = 1,   // every entry, ((L e d f), f e)
};

// F (L, e).
template <class T>
void ffn_forward(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, T* F, const Backend<T>& backend = cpu_backend<T>());
template <class T>
void ffn_jacobian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnJacobian kind, T* out,
                  const Backend<T>& backend = cpu_backend<T>());
template <class T>
void ffn_cross_hessian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnCross kind, T* out,
                       const Backend<T>& backend = cpu_backend<T>());

// What each function allocates besides its result, in elements, for the memory budget: the
// engine's estimate (engine/working_memory.hpp) on the sublayer's graph wired for its shapes only,
// plus what the function adds to it. No wrt / kind: the forward pass. T: the graph's scalar (the
// count does not depend on it).
template <class T>
index_t attention_working_memory(const AttentionDims& s, std::optional<AttentionWrt> wrt, index_t threads);
template <class T>
index_t ffn_working_memory(const FfnDims& s, std::optional<FfnJacobian> kind, index_t threads);
template <class T>
index_t ffn_cross_working_memory(const FfnDims& s, FfnCross kind, index_t threads);

}  // namespace blockhess::components

#ifndef BLOCKHESS_COMPILED
#include "blockhess/components_impl.hpp"
#endif
