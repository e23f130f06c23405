// Losses on the block output Z (B samples of L tokens, d features), averaged over the batch:
//   mse:            l = 1/(B L d) sum (Z - target)^2                     (docs/derivation.md §2.2, per sample 1/(L d))
//   cross_entropy:  l = 1/(B L) sum_t [logsumexp(Z_t) - Z_t[class_t]]    (each row of Z is a logit vector)
// Both are separable over tokens, so their Hessian with respect to Z is one d x d block per token.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::loss {

enum class Kind : int { mse = 0, cross_entropy = 1 };

template <class T>
struct Derivatives {
  T value = 0;
  Buffer<T> gZ;      // (B*L, d)    dl/dZ
  Buffer<T> hessZ;   // (B*L, d, d) d2l/dZ_t^2, only when asked for
};

// target: (B*L, d) for mse; classes: (B*L) for cross_entropy (the other may be null).
template <class T>
Derivatives<T> derivatives(Kind kind, index_t B, index_t L, index_t d, const T* Z, const T* target,
                           const std::int64_t* classes, bool with_hessian) {
  const index_t n = B * L;
  Derivatives<T> out;
  out.gZ.resize(n * d);
  if (with_hessian) out.hessZ.assign(n * d * d, T(0));
  if (kind == Kind::mse) {
    if (!target) throw std::invalid_argument("loss: mse needs a float target");
    const T c = T(1) / static_cast<T>(B * L * d);
    for (index_t k = 0; k < n * d; ++k) {
      const T r = Z[k] - target[k];
      out.value += c * r * r;
      out.gZ[k] = 2 * c * r;
    }
    if (with_hessian)
      for (index_t t = 0; t < n; ++t)
        for (index_t a = 0; a < d; ++a) out.hessZ[(t * d + a) * d + a] = 2 * c;
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
    softmax::forward_row(z, d, p.data());
    out.value += -c * std::log(p[k]);
    for (index_t a = 0; a < d; ++a) out.gZ[t * d + a] = c * (p[a] - (a == k ? T(1) : T(0)));
    if (with_hessian)
      for (index_t a = 0; a < d; ++a)
        for (index_t b = 0; b < d; ++b) out.hessZ[(t * d + a) * d + b] = c * ((a == b ? p[a] : T(0)) - p[a] * p[b]);
  }
  return out;
}

// out = (d2l/dZ^2) dZ without forming the per-token d x d blocks: the outer part's seed in a
// Hessian-vector product. mse: 2/(B L d) dZ; cross_entropy: 1/(B L) (p * dz - p (p.dz)) per row,
// p = softmax(Z_t).
template <class T>
void hessian_apply(Kind kind, index_t B, index_t L, index_t d, const T* Z, const T* dZ, T* out) {
  const index_t n = B * L;
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
