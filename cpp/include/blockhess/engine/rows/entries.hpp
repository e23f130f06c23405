// Row operations (engine/row_ops.hpp) entry by entry, shared by the nodes: an item is one entry
// of the (tokens, width) arrays.
#pragma once

#include "blockhess/config.hpp"

namespace blockhess::engine::rows {

// out = scale * x, assigned or (add) added: a diagonal Jacobian and its transpose.
template <class T>
struct ScaleEntries {
  const T* scale;
  const T* x;
  T* out;
  bool add;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const T v = scale[k] * x[k];
      out[k] = add ? out[k] + v : v;
    }
  }
};

// out = a + b: a residual connection and its tangent.
template <class T>
struct SumEntries {
  const T* a;
  const T* b;
  T* out;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = a[k] + b[k];
  }
};

// out = x, or (add) out += x: a value's cotangent share written into its slot.
template <class T>
struct WriteEntries {
  const T* x;
  T* out;
  bool add;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    if (add)
      for (index_t k = begin; k < end; ++k) out[k] += x[k];
    else
      for (index_t k = begin; k < end; ++k) out[k] = x[k];
  }
};

// out_t += b for every token t, b a row of `width` entries: a bias.
template <class T>
struct AddBias {
  const T* bias;
  T* out;
  index_t width;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] += bias[k % width];
  }
};

}  // namespace blockhess::engine::rows
