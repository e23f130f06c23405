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

}  // namespace blockhess
