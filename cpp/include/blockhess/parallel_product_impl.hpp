// matrix_product (parallel_product.hpp): one product split over the core's thread pool by blocks
// of the result.
//
// Eigen runs one product on one thread here (the core has no OpenMP). A large product is cut into
// blocks of rows or columns whose size depends on the shapes only, never on the thread count, so
// every entry comes out of the same Eigen kernel call, bit for bit, however many threads run it. Small
// products, and products inside an already parallel loop, run on the caller.
#pragma once

#include <algorithm>

#include <Eigen/Core>

#include "blockhess/config.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"

namespace blockhess {

namespace detail {
// Blocks of a product along its longer side: few and large, since each block packs the other
// operand again (at most kProductBlocks blocks, at least kProductBlockMin rows or columns each).
constexpr index_t kProductBlocks = 4;
constexpr index_t kProductBlockMin = 32;
inline index_t product_block(index_t extent) {
  return std::max<index_t>(kProductBlockMin, (extent + kProductBlocks - 1) / kProductBlocks);
}

// Eigen packs panels of both operands of a product, at most depth x rows and depth x columns;
// a pack over 128 KiB (EIGEN_STACK_ALLOCATION_LIMIT) is taken from malloc on every call. Where
// malloc's thresholds are pinned (Dask's worker processes set MALLOC_TRIM_THRESHOLD_), every such
// pack is a fresh mmap that faults in its pages: 136 faults per product of the paper's block at
// B = 64, 5% of its time. A deep product into a small result (a weight's gradient, summed over
// thousands of tokens) is therefore summed in chunks of depth whose packs fit the stack. Larger
// results are not cut: their packs are small next to their arithmetic.
constexpr index_t kStackPackBytes = 128 * 1024;
constexpr index_t kDepthChunkMin = 256;
template <class Scalar>
index_t depth_chunk(index_t depth, index_t rows, index_t cols) {
  const index_t widest = std::max<index_t>(1, std::max(rows, cols));
  const index_t chunk = kStackPackBytes / (static_cast<index_t>(sizeof(Scalar)) * widest) / 16 * 16;
  return chunk >= kDepthChunkMin && chunk < depth ? chunk : depth;
}

template <class T, int Order>
using StridedMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>, 0, Eigen::OuterStride<>>;

template <class T, int LhsOrder, int RhsOrder>
void split_product(MatrixView<T> out, MatrixView<const T> a, MatrixView<const T> b, T alpha, bool accumulate) {
  using Result = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<Result, 0, Eigen::OuterStride<>> C(out.data, out.rows, out.cols, Eigen::OuterStride<>(out.stride));
  const StridedMap<T, LhsOrder> A(a.data, a.rows, a.cols, Eigen::OuterStride<>(a.stride));
  const StridedMap<T, RhsOrder> B(b.data, b.rows, b.cols, Eigen::OuterStride<>(b.stride));
  const index_t m = C.rows(), n = C.cols(), k = A.cols();
  const bool by_rows = m >= n;
  const index_t extent = by_rows ? m : n, block = product_block(extent);
  const index_t blocks = (extent + block - 1) / block;
  const index_t chunk = depth_chunk<T>(k, by_rows ? std::min(block, m) : m, by_rows ? n : std::min(block, n));
  parallel_for(blocks, block * (by_rows ? n : m) * k, [&](index_t bl) {
    const index_t i0 = bl * block, len = std::min(block, extent - i0);
    index_t k0 = 0;
    do {  // at least once: a product of depth 0 still assigns zeros
      const index_t depth = std::min(chunk, k - k0);
      const bool add = accumulate || k0 > 0;
      const auto Ak = A.middleCols(k0, depth);
      const auto Bk = B.middleRows(k0, depth);
      if (by_rows) {
        auto Cb = C.middleRows(i0, len);
        if (add) Cb.noalias() += alpha * (Ak.middleRows(i0, len) * Bk);
        else Cb.noalias() = alpha * (Ak.middleRows(i0, len) * Bk);
      } else {
        auto Cb = C.middleCols(i0, len);
        if (add) Cb.noalias() += alpha * (Ak * Bk.middleCols(i0, len));
        else Cb.noalias() = alpha * (Ak * Bk.middleCols(i0, len));
      }
      k0 += depth;
    } while (k0 < k);
  });
}
}  // namespace detail

template <class T>
void matrix_product(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha, bool accumulate) {
  constexpr int row = Eigen::RowMajor, col = Eigen::ColMajor;
  if (A.row_major && B.row_major) detail::split_product<T, row, row>(C, A, B, alpha, accumulate);
  else if (A.row_major) detail::split_product<T, row, col>(C, A, B, alpha, accumulate);
  else if (B.row_major) detail::split_product<T, col, row>(C, A, B, alpha, accumulate);
  else detail::split_product<T, col, col>(C, A, B, alpha, accumulate);
}

}  // namespace blockhess
