// The Eigen types the core works with: row-major dynamic matrices and maps over raw buffers
// (every array the core sees is row-major, like NumPy's default).
#pragma once

#include <algorithm>

#include <Eigen/Core>

namespace blockhess {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MapC = Eigen::Map<const Mat<T>>;  // read-only view of a row-major buffer
template <class T>
using MapM = Eigen::Map<Mat<T>>;        // writable view

// out[c] (+)= sum_r M(r, c), the rows added in order: the same bits wherever `out` sits (Eigen's
// colwise().sum() into a map takes a vectorised path that depends on the destination's address,
// and a parameter's rows of H v sit at any offset of the caller's vector).
template <class T, class Matrix>
void column_sums(const Matrix& M, T* out, bool accumulate = false) {
  const Eigen::Index rows = M.rows(), cols = M.cols();
  if (!accumulate) std::fill_n(out, cols, T(0));
  for (Eigen::Index r = 0; r < rows; ++r)
    for (Eigen::Index c = 0; c < cols; ++c) out[c] += M(r, c);
}

}  // namespace blockhess
