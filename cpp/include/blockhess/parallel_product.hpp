// Matrix products split over the core's thread pool by blocks of the result.
//
// The engine calls product() on Eigen maps, blocks and transposes; product() reduces them to plain
// views (pointer, shape, row stride or column stride) and calls matrix_product<T>, the one GEMM of
// the core. Its definition (parallel_product_impl.hpp) is included here for header-only use; the
// Python modules compile it once per instruction-set level instead (BLOCKHESS_COMPILED), so that
// the engine's many call sites do not each instantiate Eigen's product machinery.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "blockhess/config.hpp"

namespace blockhess {

// A dense matrix in memory: rows x cols, `stride` apart between rows (row_major) or columns.
template <class T>
struct MatrixView {
  T* data = nullptr;
  index_t rows = 0, cols = 0, stride = 0;
  bool row_major = true;
};

// C = alpha * A * B (assign) or C += alpha * A * B (accumulate); C row-major.
template <class T>
void matrix_product(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha, bool accumulate);

namespace detail {
template <class Expr>
auto matrix_view(Expr& e) {
  using Scalar = std::remove_pointer_t<decltype(e.data())>;
  static_assert(std::decay_t<Expr>::InnerStrideAtCompileTime == 1, "product: operands must have unit inner stride");
  return MatrixView<Scalar>{e.data(), e.rows(), e.cols(), e.outerStride(),
                            (std::decay_t<Expr>::Flags & Eigen::RowMajorBit) != 0};
}
template <class T>
MatrixView<const T> read_only(MatrixView<T> v) {
  return MatrixView<const T>{v.data, v.rows, v.cols, v.stride, v.row_major};
}
}  // namespace detail

// C = alpha * A * B or C += alpha * A * B. C is a writable row-major Eigen map or block; A and B
// maps, blocks of maps or their transposes.
template <class Dst, class Lhs, class Rhs, class Scalar>
void product(Dst C, const Lhs& A, const Rhs& B, Scalar alpha, bool accumulate) {
  using T = typename Dst::Scalar;
  static_assert(Dst::IsRowMajor, "product: the result must be row-major");
  matrix_product<T>(detail::matrix_view(C), detail::read_only(detail::matrix_view(A)),
                    detail::read_only(detail::matrix_view(B)), T(alpha), accumulate);
}

}  // namespace blockhess

#ifndef BLOCKHESS_COMPILED
#include "blockhess/parallel_product_impl.hpp"
#endif
