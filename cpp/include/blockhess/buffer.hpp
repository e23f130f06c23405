// Scratch storage for the core's Eigen work.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <new>
#include <utility>
#include <vector>

#include "blockhess/memory_cache.hpp"

namespace blockhess {

// Aligned to Eigen's widest packet. With AVX-512, Eigen's vectorised reductions peel differently
// depending on an address modulo 64; aligned buffers make every result independent of where
// malloc happened to put them, so equal inputs give bit-identical Hessians on every call. Large
// buffers are reused from call to call (memory_cache.hpp).
template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > std::size_t(-1) / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(memory::allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { memory::deallocate(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const AlignedAllocator<U>&) const noexcept { return false; }
};

template <class T>
using Buffer = std::vector<T, AlignedAllocator<T>>;

// The same allocator, except that a new element is left uninitialised (default-initialised)
// instead of zeroed: growing a buffer costs no pass over its memory.
template <class T>
struct DefaultInitAllocator : AlignedAllocator<T> {
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
