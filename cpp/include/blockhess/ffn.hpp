// The FFN sublayer without residual or biases, FFN(Y) = relu(Y W_1) W_2 (docs/derivation.md §2.1, §3.4), and its
// exact derivatives. Y (L, d), W_1 (d, f), W_2 (f, e); the paper has e = d. H = Y W_1 are the
// pre-activations and D_t = diag(1[H[t,:] > 0]) the ReLU mask of token t.
//
// ReLU convention: relu'(0) = 0 (the mask is H > 0, as in PyTorch); relu'' = 0 a.e. (Lemma 1).
//
// In the vec_r numerator layout, output row t e + c (FFN[t,c]):
//   dF[t,c]/dW_1[b,g]  = Y[t,b] 1[H[t,g] > 0] W_2[g,c]                    (L e, d f)  = B_1
//   dF[t,c]/dW_2[g,c'] = relu(H)[t,g] delta_cc'                           (L e, f e)  = B_2
//   dF[t,c]/dY[u,b]    = delta_tu (W_2^T D_t W_1^T)[c,b]                  (L e, L d), block diagonal
//   d2F[t,c]/dW_1[b,g] dW_2[g',c'] = delta_gg' delta_cc' Y[t,b] 1[H[t,g] > 0]
// The last is xi_12 = dB_1/dW_2 in the paper's layout ((L e d f), f e): the corrected form of
// erratum E4. Every other second derivative of FFN with respect to (W_1, W_2) is zero.
#pragma once

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

namespace blockhess::ffn {

// relu'(h) with relu'(0) = 0.
template <class T>
BLOCKHESS_HD T relu_grad(T h) {
  return h > T(0) ? T(1) : T(0);
}

struct Dims {
  index_t L, d, f, e;  // tokens, input width, hidden width d_ff, output width
};

inline void check_dims(const Dims& s) {
  if (s.L < 1 || s.d < 1 || s.f < 1 || s.e < 1)
    throw std::invalid_argument("ffn: need L, d, d_ff, d_out >= 1, got L=" + std::to_string(s.L) +
                                ", d=" + std::to_string(s.d) + ", d_ff=" + std::to_string(s.f) +
                                ", d_out=" + std::to_string(s.e));
}

namespace detail {
inline size_t sz(index_t n) { return static_cast<size_t>(n); }

// H = Y W_1, (L, f), from aligned copies of Y and W_1 (bit-identical wherever they live).
template <class T>
Buffer<T> preactivations(const T* Y, const T* W1, const Dims& s) {
  check_dims(s);
  const Buffer<T> y = aligned_copy(Y, s.L * s.d), w1 = aligned_copy(W1, s.d * s.f);
  Buffer<T> H(sz(s.L * s.f));
  MapM<T>(H.data(), s.L, s.f).noalias() = MapC<T>(y.data(), s.L, s.d) * MapC<T>(w1.data(), s.d, s.f);
  return H;
}
}  // namespace detail

// F = relu(Y W_1) W_2, (L, e).
template <class T>
void forward(const T* Y, const T* W1, const T* W2, const Dims& s, T* F) {
  auto H = detail::preactivations(Y, W1, s);
  for (T& h : H) h = h > T(0) ? h : T(0);
  const Buffer<T> w2 = aligned_copy(W2, s.f * s.e);
  Buffer<T> out(detail::sz(s.L * s.e));
  MapM<T>(out.data(), s.L, s.e).noalias() = MapC<T>(H.data(), s.L, s.f) * MapC<T>(w2.data(), s.f, s.e);
  std::memcpy(F, out.data(), sizeof(T) * detail::sz(s.L * s.e));
}

// B_1 = dF/dW_1, (L e, d f).
template <class T>
void jacobian_w1(const T* Y, const T* W1, const T* W2, const Dims& s, T* J, FiniteRecord* record = nullptr) {
  const auto H = detail::preactivations(Y, W1, s);
  const index_t d = s.d, f = s.f, e = s.e, n = d * f;
  blockhess::detail::parallel_for(s.L, e * n, [&](index_t t) {
    const T* ht = H.data() + t * f;
    std::vector<T> masked(detail::sz(f));  // relu'(h_t) * W_2[:, c], so the inner loop is a contiguous scale
    for (index_t c = 0; c < e; ++c) {
      for (index_t g = 0; g < f; ++g) masked[detail::sz(g)] = relu_grad(ht[g]) * W2[g * e + c];
      T* row = J + (t * e + c) * n;
      for (index_t b = 0; b < d; ++b) {
        const T yb = Y[t * d + b];
        T* out = row + b * f;
        for (index_t g = 0; g < f; ++g) out[g] = yb * masked[detail::sz(g)];
      }
      note_finite(record, row, n);
    }
  });
}

// Kronecker factors of B_1: B_1[t e + c, b f + g] = Y[t, b] * M[t, c, g] with
// M[t, c, g] = relu'(H[t, g]) W_2[g, c], (L, e, f): 1/d of the dense entries.
template <class T>
void jacobian_w1_factor(const T* Y, const T* W1, const T* W2, const Dims& s, T* M) {
  const auto H = detail::preactivations(Y, W1, s);
  const index_t f = s.f, e = s.e;
  blockhess::detail::parallel_for(s.L, e * f, [&](index_t t) {
    for (index_t c = 0; c < e; ++c)
      for (index_t g = 0; g < f; ++g) M[(t * e + c) * f + g] = relu_grad(H[t * f + g]) * W2[g * e + c];
  });
}

// relu(H), (L, f): the factor of B_2 = relu(H) (x) I_e.
template <class T>
void activations(const T* Y, const T* W1, const Dims& s, T* R) {
  const auto H = detail::preactivations(Y, W1, s);
  for (index_t k = 0; k < s.L * s.f; ++k) R[k] = H[detail::sz(k)] > T(0) ? H[detail::sz(k)] : T(0);
}

// B_2 = dF/dW_2 = relu(H) (x) I_e, (L e, f e). Its entries are those of H: the record checks H.
template <class T>
void jacobian_w2(const T* Y, const T* W1, const Dims& s, T* J, FiniteRecord* record = nullptr) {
  const auto H = detail::preactivations(Y, W1, s);
  note_finite(record, H.data(), s.L * s.f);
  const index_t f = s.f, e = s.e, n = f * e;
  blockhess::detail::parallel_for(s.L, e * n, [&](index_t t) {
    T* rows = J + t * e * n;
    std::memset(rows, 0, sizeof(T) * detail::sz(e * n));
    for (index_t c = 0; c < e; ++c)
      for (index_t g = 0; g < f; ++g) {
        const T h = H[t * f + g];
        rows[c * n + g * e + c] = h > T(0) ? h : T(0);
      }
  });
}

namespace detail {
// Block t of dF/dY, W_2^T D_t W_1^T (e, d), written with row stride ld.
template <class T>
void jacobian_y_block(const T* ht, const T* W1, const T* W2, const Dims& s, T* out, index_t ld) {
  const index_t d = s.d, f = s.f, e = s.e;
  for (index_t c = 0; c < e; ++c) std::memset(out + c * ld, 0, sizeof(T) * sz(d));
  for (index_t g = 0; g < f; ++g) {
    if (!(ht[g] > T(0))) continue;  // relu'(h) = 0 for h <= 0
    for (index_t c = 0; c < e; ++c) {
      const T w2 = W2[g * e + c];
      T* row = out + c * ld;
      for (index_t b = 0; b < d; ++b) row[b] += W1[b * f + g] * w2;
    }
  }
}
}  // namespace detail

// dF/dY blocks (L, e, d): block t is W_2^T D_t W_1^T (dF[t]/dY[u] = 0 for u != t).
template <class T>
void jacobian_y_blocks(const T* Y, const T* W1, const T* W2, const Dims& s, T* J,
                       FiniteRecord* record = nullptr) {
  const auto H = detail::preactivations(Y, W1, s);
  blockhess::detail::parallel_for(s.L, s.e * s.d * s.f, [&](index_t t) {
    detail::jacobian_y_block(H.data() + t * s.f, W1, W2, s, J + t * s.e * s.d, s.d);
    note_finite(record, J + t * s.e * s.d, s.e * s.d);
  });
}

// dF/dY dense (L e, L d), block diagonal.
template <class T>
void jacobian_y_dense(const T* Y, const T* W1, const T* W2, const Dims& s, T* J,
                      FiniteRecord* record = nullptr) {
  const auto H = detail::preactivations(Y, W1, s);
  const index_t n = s.L * s.d;
  blockhess::detail::parallel_for(s.L, s.e * (n + s.d * s.f), [&](index_t t) {
    T* rows = J + t * s.e * n;
    std::memset(rows, 0, sizeof(T) * detail::sz(s.e * n));
    detail::jacobian_y_block(H.data() + t * s.f, W1, W2, s, rows + t * s.d, n);
    for (index_t c = 0; c < s.e; ++c) note_finite(record, rows + c * n + t * s.d, s.d);
  });
}

// The nonzero values of d2F/dW_1 dW_2, (L, d, f): C[t,b,g] = Y[t,b] 1[H[t,g] > 0]
// (= d2F[t,c]/dW_1[b,g] dW_2[g,c] for every c).
template <class T>
void cross_hessian_blocks(const T* Y, const T* W1, const Dims& s, T* C) {
  const auto H = detail::preactivations(Y, W1, s);
  const index_t d = s.d, f = s.f;
  blockhess::detail::parallel_for(s.L, d * f, [&](index_t t) {
    for (index_t b = 0; b < d; ++b)
      for (index_t g = 0; g < f; ++g) C[(t * d + b) * f + g] = Y[t * d + b] * relu_grad(H[t * f + g]);
  });
}

// d2F/dW_1 dW_2 in the paper's layout ((L e d f), f e): row (t e + c) d f + b f + g, column g e + c.
template <class T>
void cross_hessian_dense(const T* Y, const T* W1, const Dims& s, T* out) {
  const auto H = detail::preactivations(Y, W1, s);
  const index_t d = s.d, f = s.f, e = s.e, n1 = d * f, n2 = f * e;
  blockhess::detail::parallel_for(s.L, e * n1 * n2, [&](index_t t) {
    T* slab = out + t * e * n1 * n2;
    std::memset(slab, 0, sizeof(T) * detail::sz(e * n1 * n2));
    for (index_t c = 0; c < e; ++c)
      for (index_t b = 0; b < d; ++b)
        for (index_t g = 0; g < f; ++g)
          slab[(c * n1 + b * f + g) * n2 + g * e + c] = Y[t * d + b] * relu_grad(H[t * f + g]);
  });
}

}  // namespace blockhess::ffn
