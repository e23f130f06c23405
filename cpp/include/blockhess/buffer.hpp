// Scratch storage for the core's Eigen work.
#pragma once

#include <Eigen/Core>
#include <new>
#include <utility>
#include <vector>

namespace blockhess {

// Aligned to Eigen's widest packet. With AVX-512, Eigen's vectorised reductions peel differently
// depending on an address modulo 64; aligned buffers make every result independent of where
// malloc happened to put them, so equal inputs give bit-identical Hessians on every call.
template <class T>
using Buffer = std::vector<T, Eigen::aligned_allocator<T>>;

// Eigen's aligned allocator, except that a new element is left uninitialised (default-initialised)
// instead of zeroed: growing a buffer costs no pass over its memory.
template <class T>
struct DefaultInitAllocator : Eigen::aligned_allocator<T> {
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) {}
  template <class U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// Aligned storage whose new elements hold whatever the memory held: for buffers that every user
// writes before reading (a pass's cotangents and tangents). Zeroing them would be a wasted pass.
template <class T>
using RawBuffer = std::vector<T, DefaultInitAllocator<T>>;

// An aligned copy of n values from wherever the caller keeps them: every input that reaches an
// Eigen product goes through one, so results never depend on the caller's alignment.
template <class T>
Buffer<T> aligned_copy(const T* values, std::ptrdiff_t n) {
  return Buffer<T>(values, values + n);
}

}  // namespace blockhess
