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

// out = alpha * x entry by entry (an item is an entry): the mean squared error's second
// derivative, 2/(B L d) I, applied to a tangent.
template <class T>
struct ScaleBy {
  T alpha;
  const T* x;
  T* out;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = alpha * x[k];
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

}  // namespace blockhess::engine::rows
