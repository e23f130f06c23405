// Matrix products split over the core's thread pool by rows of the result.
//
// Eigen runs one product on one thread here (the core has no OpenMP). A product with many rows is
// cut into row blocks whose size depends on the shapes only, never on the thread count, so every
// entry comes out of the same Eigen kernel call, bit for bit, however many threads run it. Small
// products, and products inside an already parallel loop, run on the caller.
#pragma once

#include <algorithm>

#include "blockhess/config.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess {

namespace detail {
// Row blocks of a product: at least 16 rows each, at most 16 blocks.
inline index_t product_block_rows(index_t rows) { return std::max<index_t>(16, (rows + 15) / 16); }
}  // namespace detail

// C = alpha * A * B (assign) or C += alpha * A * B (accumulate). C is a writable Eigen map or
// block; A and B any Eigen expressions whose rows can be sliced (maps, their transposes).
template <class Dst, class Lhs, class Rhs, class Scalar>
void product(Dst C, const Lhs& A, const Rhs& B, Scalar alpha, bool accumulate) {
  const index_t m = C.rows(), block = detail::product_block_rows(m);
  const index_t blocks = (m + block - 1) / block;
  detail::parallel_for(blocks, block * C.cols() * A.cols(), [&](index_t b) {
    const index_t r0 = b * block, rn = std::min(block, m - r0);
    auto Cb = C.middleRows(r0, rn);
    if (accumulate) Cb.noalias() += alpha * (A.middleRows(r0, rn) * B);
    else Cb.noalias() = alpha * (A.middleRows(r0, rn) * B);
  });
}

}  // namespace blockhess
