// Losses on the block output Z (B samples of L tokens, d features), averaged over the batch:
//   mse:            l = 1/(B L d) sum (Z - target)^2                     (docs/derivation.md §2.2, per sample 1/(L d))
//   cross_entropy:  l = 1/(B L) sum_t [logsumexp(Z_t) - Z_t[class_t]]    (each row of Z is a logit vector;
//                   formed in that form, softmax::cross_entropy_row, so large logit gaps stay finite)
//   pooled_cross_entropy (the paper's ViT classifier head, docs/derivation.md §2.2):
//                   m_b = 1/L sum_t Z_b,t,  logits_b = m_b W_C + b_C,
//                   l = 1/B sum_b [logsumexp(logits_b) - logits_b[class_b]]
// The first two are separable over tokens, so their Hessian with respect to Z is one d x d block per
// token. The pooled loss couples every pair of tokens of a sample through the mean: its Hessian
// d2l / dZ_b,t dZ_b,s = 1/L^2 W_C Omega_b W_C^T (Omega_b = (diag p_b - p_b p_b^T) / B) is one d x d
// block per sample, the same for every pair (t, s).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::loss {

enum class Kind : int { mse = 0, cross_entropy = 1, pooled_cross_entropy = 2 };

// The fixed classifier of pooled_cross_entropy: W_C (d, classes) row-major and b_C (classes).
template <class T>
struct Head {
  const T* weight = nullptr;
  const T* bias = nullptr;
  index_t classes = 0;
};

template <class T>
struct Derivatives {
  T value = 0;
  Buffer<T> gZ;      // (B*L, d)    dl/dZ
  Buffer<T> hessZ;   // (B*L, d, d) d2l/dZ_t^2, only when asked for (separable losses)
  bool hessZ_diagonal = false;  // hessZ holds only the diagonals, (B*L, d): mse's 2/(B L d) I
  Buffer<T> pooledZ; // (B, d, d) d2l/dZ_b,t dZ_b,s for every pair (t, s) of sample b (pooled loss)
};

template <class T>
Derivatives<T> pooled_derivatives(index_t B, index_t L, index_t d, const T* Z, const std::int64_t* classes,
                                  const Head<T>& head);

// target: (B*L, d) for mse; classes: (B*L) for cross_entropy, (B) for pooled_cross_entropy (the
// other may be null); head: pooled_cross_entropy's classifier.
template <class T>
Derivatives<T> derivatives(Kind kind, index_t B, index_t L, index_t d, const T* Z, const T* target,
                           const std::int64_t* classes, bool with_hessian, const Head<T>& head = {}) {
  if (kind == Kind::pooled_cross_entropy) return pooled_derivatives(B, L, d, Z, classes, head);
  const index_t n = B * L;
  Derivatives<T> out;
  out.gZ.resize(n * d);
  if (with_hessian && kind != Kind::mse) out.hessZ.assign(n * d * d, T(0));
  if (kind == Kind::mse) {
    if (!target) throw std::invalid_argument("loss: mse needs a float target");
    const T c = T(1) / static_cast<T>(B * L * d);
    for (index_t k = 0; k < n * d; ++k) {
      const T r = Z[k] - target[k];
      out.value += c * r * r;
      out.gZ[k] = 2 * c * r;
    }
    if (with_hessian) {  // a multiple of the identity: kept as its diagonal (a diagonal site)
      out.hessZ.assign(n * d, 2 * c);
      out.hessZ_diagonal = true;
    }
    return out;
  }
  if (!classes) throw std::invalid_argument("loss: cross_entropy needs integer class targets");
  const T c = T(1) / static_cast<T>(B * L);
  Buffer<T> p(d);
  for (index_t t = 0; t < n; ++t) {
    const std::int64_t k = classes[t];
    if (k < 0 || k >= d)
      throw std::invalid_argument("loss: class index " + std::to_string(k) + " is out of range [0, " +
                                  std::to_string(d) + ")");
    const T* z = Z + t * d;
    out.value += c * softmax::cross_entropy_row(z, d, k, p.data());
    for (index_t a = 0; a < d; ++a) out.gZ[t * d + a] = c * (p[a] - (a == k ? T(1) : T(0)));
    if (with_hessian)
      for (index_t a = 0; a < d; ++a)
        for (index_t b = 0; b < d; ++b) out.hessZ[(t * d + a) * d + b] = c * ((a == b ? p[a] : T(0)) - p[a] * p[b]);
  }
  return out;
}

// The pooled loss, its gradient (the same row 1/L W_C (p_b - e_class) / B for every token of sample
// b) and its per-sample Hessian block (always: B d^2 numbers, and the HVP's seed needs it).
template <class T>
Derivatives<T> pooled_derivatives(index_t B, index_t L, index_t d, const T* Z, const std::int64_t* classes,
                                  const Head<T>& head) {
  if (!classes) throw std::invalid_argument("loss: pooled_cross_entropy needs integer class targets");
  if (!head.weight || !head.bias || head.classes < 1)
    throw std::invalid_argument("loss: pooled_cross_entropy needs a head (W_C, b_C)");
  const index_t C = head.classes;
  Derivatives<T> out;
  out.gZ.resize(B * L * d);
  out.pooledZ.resize(B * d * d);
  Buffer<T> m(d), logits(C), p(C), gm(d), WO(d * C);
  const T inv_B = T(1) / static_cast<T>(B), inv_L = T(1) / static_cast<T>(L);
  for (index_t b = 0; b < B; ++b) {
    const std::int64_t k = classes[b];
    if (k < 0 || k >= C)
      throw std::invalid_argument("loss: class index " + std::to_string(k) + " is out of range [0, " +
                                  std::to_string(C) + ")");
    std::fill(m.begin(), m.end(), T(0));
    for (index_t t = 0; t < L; ++t)
      for (index_t a = 0; a < d; ++a) m[a] += Z[(b * L + t) * d + a];
    for (index_t a = 0; a < d; ++a) m[a] *= inv_L;
    for (index_t c = 0; c < C; ++c) {
      T s = head.bias[c];
      for (index_t a = 0; a < d; ++a) s += m[a] * head.weight[a * C + c];
      logits[c] = s;
    }
    out.value += inv_B * softmax::cross_entropy_row(logits.data(), C, k, p.data());
    for (index_t a = 0; a < d; ++a) {
      T s = 0;
      for (index_t c = 0; c < C; ++c) s += head.weight[a * C + c] * (p[c] - (c == k ? T(1) : T(0)));
      gm[a] = inv_B * inv_L * s;
    }
    for (index_t t = 0; t < L; ++t) std::copy(gm.begin(), gm.end(), out.gZ.begin() + (b * L + t) * d);
    // 1/(B L^2) W_C (diag p - p p^T) W_C^T = 1/(B L^2) [(W_C diag p) W_C^T - (W_C p)(W_C p)^T].
    for (index_t a = 0; a < d; ++a) {
      T wp = 0;
      for (index_t c = 0; c < C; ++c) wp += head.weight[a * C + c] * p[c];
      gm[a] = wp;
    }
    const T scale = inv_B * inv_L * inv_L;
    T* G = out.pooledZ.data() + b * d * d;
    for (index_t a = 0; a < d; ++a)
      for (index_t e = a; e < d; ++e) {
        T s = 0;
        for (index_t c = 0; c < C; ++c) s += head.weight[a * C + c] * p[c] * head.weight[e * C + c];
        G[a * d + e] = G[e * d + a] = scale * (s - gm[a] * gm[e]);  // symmetric by construction
      }
  }
  return out;
}

// out = (d2l/dZ^2) dZ without forming the per-token d x d blocks: the outer part's seed in a
// Hessian-vector product. mse: 2/(B L d) dZ; cross_entropy: 1/(B L) (p * dz - p (p.dz)) per row,
// p = softmax(Z_t); pooled_cross_entropy: every row of sample b gets G_b sum_s dZ_b,s, with
// G_b = pooledZ's block (Derivatives::pooledZ).
template <class T>
void hessian_apply(Kind kind, index_t B, index_t L, index_t d, const T* Z, const T* dZ, T* out,
                   const T* pooledZ = nullptr) {
  const index_t n = B * L;
  if (kind == Kind::pooled_cross_entropy) {
    if (!pooledZ) throw std::logic_error("loss: the pooled Hessian-vector product needs the per-sample blocks");
    Buffer<T> sum(d), row(d);
    for (index_t b = 0; b < B; ++b) {
      std::fill(sum.begin(), sum.end(), T(0));
      for (index_t t = 0; t < L; ++t)
        for (index_t a = 0; a < d; ++a) sum[a] += dZ[(b * L + t) * d + a];
      const T* G = pooledZ + b * d * d;
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t e = 0; e < d; ++e) s += G[a * d + e] * sum[e];
        row[a] = s;
      }
      for (index_t t = 0; t < L; ++t) std::copy(row.begin(), row.end(), out + (b * L + t) * d);
    }
    return;
  }
  if (kind == Kind::mse) {
    const T c2 = 2 * (T(1) / static_cast<T>(B * L * d));
    for (index_t k = 0; k < n * d; ++k) out[k] = c2 * dZ[k];
    return;
  }
  const T c = T(1) / static_cast<T>(B * L);
  Buffer<T> p(d);
  for (index_t t = 0; t < n; ++t) {
    softmax::forward_row(Z + t * d, d, p.data());
    T pdz = 0;
    for (index_t a = 0; a < d; ++a) pdz += p[a] * dZ[t * d + a];
    for (index_t a = 0; a < d; ++a) out[t * d + a] = c * p[a] * (dZ[t * d + a] - pdz);
  }
}

}  // namespace blockhess::loss
