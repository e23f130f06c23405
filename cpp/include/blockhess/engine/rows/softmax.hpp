// The attention's row softmax (engine/nodes/attention.hpp) as row operations (engine/row_ops.hpp):
// an item is one row of one head's (L, L) weights, rows of every head and sample one after another.
#pragma once

#include "blockhess/config.hpp"
#include "blockhess/math.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine::rows {

// a = softmax of each logit row, in place; causal: a row's entries past its own position (the row's
// index within its (L, L) block) are -inf first, so they weigh 0.
template <class T>
struct SoftmaxRows {
  T* a;
  index_t L;
  bool causal;
  index_t cost() const { return 8 * L; }  // an exp an entry
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t r = begin; r < end; ++r) {
      T* row = a + r * L;
      if (causal)
        for (index_t k = r % L + 1; k < L; ++k) row[k] = -math::infinity<T>();
      softmax::forward_row(row, L, row);
    }
  }
};

// gt = J^T g of each row: the logits' cotangent from the weights'.
template <class T>
struct SoftmaxVjpRows {
  const T* a;
  const T* g;
  T* gt;
  index_t L;
  index_t cost() const { return 3 * L; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t r = begin; r < end; ++r) softmax::vjp_row(a + r * L, g + r * L, L, gt + r * L);
  }
};

// out = J_t dT_t column by column, for the (L, cols) blocks dT_t (rows of L (L, cols) blocks one
// after another, one a row of the weights a): how a row of the weights moves with tangents dT_t of
// its logits (J_t is symmetric). An item is a column (t, c).
template <class T>
struct SoftmaxJacobianColumns {
  const T* a;
  const T* dT;
  T* out;
  index_t L, cols;
  index_t cost() const { return 3 * L; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const index_t t = k / cols, offset = t * L * cols + k % cols;
      softmax::vjp_row(a + t * L, dT + offset, L, out + offset, cols);
    }
  }
};

// dgt = the tangent of each row's J^T g as the row's weights move by da and g by dg (the
// Hessian-vector product's reverse pass through the softmax).
template <class T>
struct SoftmaxCotangentTangentRows {
  const T* a;
  const T* da;
  const T* g;
  const T* dg;
  T* dgt;
  index_t L;
  index_t cost() const { return 6 * L; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t r = begin; r < end; ++r)
      softmax::vjp_tangent_row(a + r * L, da + r * L, g + r * L, dg + r * L, L, dgt + r * L);
  }
};

}  // namespace blockhess::engine::rows
