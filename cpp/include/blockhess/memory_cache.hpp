// The core's large buffers, kept for the next call instead of handed back to the system.
//
// A call's working memory (values, cotangents, tangents, factors) is freed when it returns. glibc
// gives large freed blocks back to the system (it maps them on their own, or trims the heap's free
// top), so the next call gets fresh pages, and every fresh 4 KiB page costs the kernel a fault and
// a zero fill when first written: at (L, d, d_k, d_ff) = (128, 256, 256, 1024) in float64 that was
// 40% of a Hessian-vector product (55 -> 33 ms on a 2-core VM) and half of a gradient. Blocks of
// 256 KiB and more therefore go through this cache: a freed block waits for a request of its size
// class (eight classes per power of two, so a block is at most 1/8 larger than asked), up to a
// limit on the bytes held (256 MiB unless set_limit says otherwise); beyond the limit it is freed.
// A request no held block serves frees them all first, so that malloc can reuse their memory.
// What the cache holds never changes a result: every block is aligned alike, and every buffer is
// initialised (or written before it is read) by its user.
//
// One cache per process, shared by every thread (a mutex guards it; a call takes a few hundred
// blocks). A forked child starts with an empty one (a block the parent held stays allocated, and
// one the child frees joins the child's cache: it is the child's memory too).
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "blockhess/process_singleton.hpp"

namespace blockhess::memory {

constexpr std::size_t kCachedBytes = std::size_t(1) << 18;  // blocks below this come from malloc directly
constexpr std::size_t kDefaultLimit = std::size_t(256) << 20;

// The size a request of `bytes` (>= kCachedBytes) is served with: rounded up to 1/8 of its power of two.
inline std::size_t size_class(std::size_t bytes) {
  std::size_t top = 1;
  while (top <= bytes / 2) top *= 2;  // the largest power of two <= bytes
  const std::size_t step = top / 8;
  return (bytes + step - 1) / step * step;
}

namespace detail {

class Cache {
 public:
  // A held block of the class, else a new one. A miss (a call of new sizes) first hands every
  // held block back to malloc, which can then reuse their memory: the cache never holds memory a
  // call could have reused, so a call's peak stays what it would be without it.
  void* take(std::size_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        held_ -= size;
        return p;
      }
    }
    release();
    return Eigen::internal::aligned_malloc(size);  // throws std::bad_alloc
  }
  void give(void* p, std::size_t size) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_ + size <= limit_) {
        try {
          free_[size].push_back(p);
          held_ += size;
          return;
        } catch (...) {  // no room to note it: free it instead
        }
      }
    }
    Eigen::internal::aligned_free(p);
  }
  // Frees every block held; returns how many bytes that was.
  std::size_t release() {
    std::map<std::size_t, std::vector<void*>> blocks;
    std::size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
      bytes = held_;
      held_ = 0;
    }
    for (auto& [size, list] : blocks)
      for (void* p : list) Eigen::internal::aligned_free(p);
    return bytes;
  }
  void set_limit(std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      if (held_ <= limit_) return;
    }
    release();
  }
  std::size_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  std::size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;  // by size class
  std::size_t held_ = 0, limit_ = kDefaultLimit;
};

// Created on first use and deliberately leaked (process_singleton.hpp): buffers may be freed by
// static destructors after any cache destructor would have run.
inline Cache& cache() { return blockhess::detail::process_singleton<Cache>(); }

}  // namespace detail

// Storage for `bytes`, aligned for Eigen's widest packet.
inline void* allocate(std::size_t bytes) {
  if (bytes < kCachedBytes) return Eigen::internal::aligned_malloc(bytes);
  return detail::cache().take(size_class(bytes));
}

// Gives back storage from allocate(bytes) (the same byte count).
inline void deallocate(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes < kCachedBytes) return Eigen::internal::aligned_free(p);
  detail::cache().give(p, size_class(bytes));
}

// The most bytes the cache keeps (0: none; lowering it frees what is over), what it holds now, and
// freeing all of it (returns the bytes freed).
inline void set_cache_limit(std::size_t bytes) { detail::cache().set_limit(bytes); }
inline std::size_t cache_limit() { return detail::cache().limit(); }
inline std::size_t cached_bytes() { return detail::cache().held(); }
inline std::size_t release_cached() { return detail::cache().release(); }

}  // namespace blockhess::memory
