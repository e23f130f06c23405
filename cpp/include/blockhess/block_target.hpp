// What the block's curvature is taken of: the loss target and the part of the Hessian.
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"
#include "blockhess/loss.hpp"

namespace blockhess::block {

// The full Hessian, its outer (Gauss-Newton) part or its functional part (docs/derivation.md §4.1).
enum class Part : int { full = 0, outer = 1, functional = 2 };

// What the loss is measured against: float targets (mse) or class indices (cross_entropy: one per
// token; pooled_cross_entropy: one per sample, through the fixed classifier `head`).
template <class T>
struct Target {
  loss::Kind kind = loss::Kind::mse;
  const T* values = nullptr;              // (B*L, d)
  const std::int64_t* classes = nullptr;  // (B*L), or (B) when pooled
  loss::Head<T> head;                     // pooled_cross_entropy only

  bool pooled() const { return kind == loss::Kind::pooled_cross_entropy; }
  loss::Derivatives<T> derivatives(index_t B, index_t L, index_t d, const T* Z, bool with_hessian) const {
    return loss::derivatives(kind, B, L, d, Z, values, classes, with_hessian, head);
  }
};

}  // namespace blockhess::block
