// The Eigen types the core works with: row-major dynamic matrices and maps over raw buffers
// (every array the core sees is row-major, like NumPy's default).
#pragma once

#include <Eigen/Core>

namespace blockhess {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MapC = Eigen::Map<const Mat<T>>;  // read-only view of a row-major buffer
template <class T>
using MapM = Eigen::Map<Mat<T>>;        // writable view

}  // namespace blockhess
