// Matrix products split over the core's thread pool by blocks of the result.
//
// The engine calls product() on Eigen maps, blocks and transposes; product() reduces them to plain
// views (pointer, shape, row stride or column stride) and hands them to its backend's gemm
// (backend.hpp). On the host that is matrix_product<T>, the one GEMM of the core. Its definition (parallel_product_impl.hpp) is included here for header-only use; the
// Python modules compile it once per instruction-set level instead (BLOCKHESS_COMPILED), so that
// the engine's many call sites do not each instantiate Eigen's product machinery.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "blockhess/backend.hpp"
#include "blockhess/config.hpp"

namespace blockhess {

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
}  // namespace detail

// C = alpha * A * B or C += alpha * A * B on `backend`. C is a writable row-major Eigen map or
// block; A and B maps, blocks of maps or their transposes.
template <class T, class Dst, class Lhs, class Rhs, class Scalar>
void product(const Backend<T>& backend, Dst C, const Lhs& A, const Rhs& B, Scalar alpha, bool accumulate) {
  static_assert(std::is_same_v<typename Dst::Scalar, T>, "product: the result's type is the backend's");
  static_assert(Dst::IsRowMajor, "product: the result must be row-major");
  backend.gemm(detail::matrix_view(C), read_only(detail::matrix_view(A)), read_only(detail::matrix_view(B)), T(alpha),
               accumulate);
}

// `count` products, the k-th on C, A and B moved by k * step elements each (Backend::gemm_batched):
// every head of a sample, say, given the first head's views.
template <class T, class Dst, class Lhs, class Rhs, class Scalar>
void batched_product(const Backend<T>& backend, index_t count, Dst C, index_t c_step, const Lhs& A, index_t a_step,
                     const Rhs& B, index_t b_step, Scalar alpha, bool accumulate) {
  static_assert(std::is_same_v<typename Dst::Scalar, T>, "batched_product: the result's type is the backend's");
  static_assert(Dst::IsRowMajor, "batched_product: the result must be row-major");
  backend.gemm_batched(count, detail::matrix_view(C), c_step, read_only(detail::matrix_view(A)), a_step,
                       read_only(detail::matrix_view(B)), b_step, T(alpha), accumulate);
}

}  // namespace blockhess

#ifndef BLOCKHESS_COMPILED
#include "blockhess/parallel_product_impl.hpp"
#endif
