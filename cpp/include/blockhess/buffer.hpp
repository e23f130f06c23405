// Scratch storage for the core's Eigen work.
#pragma once

#include <Eigen/Core>
#include <vector>

namespace blockhess {

// Aligned to Eigen's widest packet. With AVX-512, Eigen's vectorised reductions peel differently
// depending on an address modulo 64; aligned buffers make every result independent of where
// malloc happened to put them, so equal inputs give bit-identical Hessians on every call.
template <class T>
using Buffer = std::vector<T, Eigen::aligned_allocator<T>>;

// An aligned copy of n values from wherever the caller keeps them: every input that reaches an
// Eigen product goes through one, so results never depend on the caller's alignment.
template <class T>
Buffer<T> aligned_copy(const T* values, std::ptrdiff_t n) {
  return Buffer<T>(values, values + n);
}

}  // namespace blockhess
