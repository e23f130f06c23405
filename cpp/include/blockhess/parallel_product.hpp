// Matrix products split over the core's thread pool by blocks of the result.
//
// Eigen runs one product on one thread here (the core has no OpenMP). A large product is cut into
// blocks of rows or columns whose size depends on the shapes only, never on the thread count, so
// every entry comes out of the same Eigen kernel call, bit for bit, however many threads run it. Small
// products, and products inside an already parallel loop, run on the caller.
#pragma once

#include <algorithm>

#include "blockhess/config.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess {

namespace detail {
// Blocks of a product along its longer side: few and large, since each block packs the other
// operand again (at most kProductBlocks blocks, at least kProductBlockMin rows or columns each).
constexpr index_t kProductBlocks = 4;
constexpr index_t kProductBlockMin = 32;
inline index_t product_block(index_t extent) {
  return std::max<index_t>(kProductBlockMin, (extent + kProductBlocks - 1) / kProductBlocks);
}
}  // namespace detail

// C = alpha * A * B (assign) or C += alpha * A * B (accumulate). C is a writable Eigen map or
// block; A and B any Eigen expressions whose rows and columns can be sliced (maps, transposes).
template <class Dst, class Lhs, class Rhs, class Scalar>
void product(Dst C, const Lhs& A, const Rhs& B, Scalar alpha, bool accumulate) {
  const index_t m = C.rows(), n = C.cols(), k = A.cols();
  const bool by_rows = m >= n;
  const index_t extent = by_rows ? m : n, block = detail::product_block(extent);
  const index_t blocks = (extent + block - 1) / block;
  detail::parallel_for(blocks, block * (by_rows ? n : m) * k, [&](index_t b) {
    const index_t i0 = b * block, len = std::min(block, extent - i0);
    if (by_rows) {
      auto Cb = C.middleRows(i0, len);
      if (accumulate) Cb.noalias() += alpha * (A.middleRows(i0, len) * B);
      else Cb.noalias() = alpha * (A.middleRows(i0, len) * B);
    } else {
      auto Cb = C.middleCols(i0, len);
      if (accumulate) Cb.noalias() += alpha * (A * B.middleCols(i0, len));
      else Cb.noalias() = alpha * (A * B.middleCols(i0, len));
    }
  });
}

}  // namespace blockhess
