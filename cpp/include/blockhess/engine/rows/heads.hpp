// The losses' per-token work (engine/heads/) as row operations (engine/row_ops.hpp).
#pragma once

#include "blockhess/config.hpp"

namespace blockhess::engine::rows {

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
