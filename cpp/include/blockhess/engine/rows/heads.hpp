// The losses' per-token work (engine/heads/) as row operations (engine/row_ops.hpp).
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine::rows {

// Per token (an item is a token's row of d outputs): the mean squared error's terms
// scale (z - y)^2, summed along the row into row_loss, and its gradient 2 scale (z - y).
template <class T>
struct MseRows {
  const T* z;
  const T* target;
  T* gz;
  T* row_loss;
  index_t d;
  T scale;
  index_t cost() const { return 3 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t) {
      T sum = 0;
      for (index_t k = t * d; k < (t + 1) * d; ++k) {
        const T r = z[k] - target[k];
        sum += scale * r * r;
        gz[k] = 2 * scale * r;
      }
      row_loss[t] = sum;
    }
  }
};

// Per token (an item is a token's row of d logits): the cross-entropy against its class,
// scale (logsumexp(z) - z[class]) into row_loss, p = softmax(z), and the gradient scale (p - e_class);
// a token whose class is `ignored` (with ignoring) counts for nothing: 0 loss, p and gradient 0.
// The classes are in range (checked before).
template <class T>
struct CrossEntropyRows {
  const T* z;
  const std::int64_t* classes;
  T* p;
  T* gz;
  T* row_loss;
  index_t d;
  T scale;
  bool ignoring;
  std::int64_t ignored;
  index_t cost() const { return 4 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t) {
      const std::int64_t c = classes[t];
      T *p_t = p + t * d, *g_t = gz + t * d;
      if (ignoring && c == ignored) {
        for (index_t a = 0; a < d; ++a) p_t[a] = T(0), g_t[a] = T(0);
        row_loss[t] = T(0);
        continue;
      }
      row_loss[t] = scale * softmax::cross_entropy_row(z + t * d, d, static_cast<index_t>(c), p_t);
      for (index_t a = 0; a < d; ++a) g_t[a] = scale * (p_t[a] - (a == c ? T(1) : T(0)));
    }
  }
};

// Per token (an item is a token's row of d logits): the cross-entropy's second derivative
// scale (diag p - p p^T) applied to the tangent dz, scale p * (dz - p . dz).
template <class T>
struct CrossEntropyTangentRows {
  const T* p;
  const T* dz;
  T* out;
  index_t d;
  T scale;
  index_t cost() const { return 3 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t) {
      const T *p_t = p + t * d, *dz_t = dz + t * d;
      T pdz = 0;
      for (index_t a = 0; a < d; ++a) pdz += p_t[a] * dz_t[a];
      for (index_t a = 0; a < d; ++a) out[t * d + a] = scale * p_t[a] * (dz_t[a] - pdz);
    }
  }
};

// Per sample (an item is a sample's L rows of d): the pooled cross-entropy's forward pass
// (heads/pooled_cross_entropy.hpp). The mean m_b of its rows, its logits m_b W_C + b_C (W_C, b_C
// null: the identity, d = C), p_b = softmax of them, the sample's loss scale (logsumexp - logit of
// its class) into row_loss, the gradient 1/(B L) W_C (p_b - e_class) into each of its rows of gz,
// and W_C p_b into wp (its second derivative's blocks need it). The classes are in range (checked
// before). Scratch: m_b and the logits.
template <class T>
struct PooledCrossEntropyRows {
  const T* z;
  const std::int64_t* classes;
  const T* weight;  // W_C (d, C) row-major, or null
  const T* bias;    // b_C (C), or null
  T* p;             // (B, C)
  T* wp;            // (B, d)
  T* gz;            // (B L, d)
  T* row_loss;      // (B)
  index_t L, d, C;
  T inv_B, inv_L;
  index_t cost() const { return L * d + 3 * d * C; }
  index_t scratch_size() const { return d + C; }
  BLOCKHESS_HD T w(index_t a, index_t c) const { return weight ? weight[a * C + c] : (a == c ? T(1) : T(0)); }
  BLOCKHESS_HD void operator()(index_t begin, index_t end, T* scratch) const {
    T *m = scratch, *logits = scratch + d;
    for (index_t b = begin; b < end; ++b) {
      const std::int64_t k = classes[b];
      for (index_t a = 0; a < d; ++a) m[a] = T(0);
      for (index_t t = 0; t < L; ++t)
        for (index_t a = 0; a < d; ++a) m[a] += z[(b * L + t) * d + a];
      for (index_t a = 0; a < d; ++a) m[a] *= inv_L;
      for (index_t c = 0; c < C; ++c) {
        T s = bias ? bias[c] : T(0);
        for (index_t a = 0; a < d; ++a) s += m[a] * w(a, c);
        logits[c] = s;
      }
      T* p_b = p + b * C;
      row_loss[b] = inv_B * softmax::cross_entropy_row(logits, C, static_cast<index_t>(k), p_b);
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t c = 0; c < C; ++c) s += w(a, c) * (p_b[c] - (c == k ? T(1) : T(0)));
        const T g = inv_B * inv_L * s;
        for (index_t t = 0; t < L; ++t) gz[(b * L + t) * d + a] = g;
      }
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t c = 0; c < C; ++c) s += w(a, c) * p_b[c];
        wp[b * d + a] = s;
      }
    }
  }
};

// Each sample's (d, d) block of the pooled cross-entropy's second derivative (an item is an entry),
//   G_b = scale [(W_C diag p_b) W_C^T - (W_C p_b)(W_C p_b)^T],
// an entry and its mirror computed alike (from the lower index first): symmetric by construction.
template <class T>
struct PooledBlockEntries {
  const T* p;       // (B, C)
  const T* wp;      // (B, d): W_C p_b
  const T* weight;  // W_C (d, C), or null: the identity
  T* G;             // (B, d, d)
  index_t d, C;
  T scale;
  index_t cost() const { return C; }
  BLOCKHESS_HD T w(index_t a, index_t c) const { return weight ? weight[a * C + c] : (a == c ? T(1) : T(0)); }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const index_t b = k / (d * d), r = k % (d * d);
      const index_t lo = r / d < r % d ? r / d : r % d, hi = r / d < r % d ? r % d : r / d;
      const T* p_b = p + b * C;
      T s = 0;
      for (index_t c = 0; c < C; ++c) s += w(lo, c) * p_b[c] * w(hi, c);
      G[k] = scale * (s - wp[b * d + lo] * wp[b * d + hi]);
    }
  }
};

// out_b,t = G_b sum_s x_b,s for every token t of sample b (an item is an entry of out): the pooled
// cross-entropy's second derivative on a tangent; sums: (B, d), each sample's rows of x summed
// (SampleSums).
template <class T>
struct PooledBlockApply {
  const T* G;     // (B, d, d)
  const T* sums;  // (B, d)
  T* out;         // (B L, d)
  index_t L, d;
  index_t cost() const { return d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const index_t b = k / (L * d), a = k % d;
      const T *row = G + (b * d + a) * d, *sum = sums + b * d;
      T s = 0;
      for (index_t e = 0; e < d; ++e) s += row[e] * sum[e];
      out[k] = s;
    }
  }
};

}  // namespace blockhess::engine::rows
