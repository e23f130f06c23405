// Storage in a backend's memory (backend.hpp): the engine's values, cotangents, tangents and the
// nodes' caches, on the host (the memory cache, aligned like Buffer, so the host's results keep
// their bits) or on a GPU.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "blockhess/backend.hpp"
#include "blockhess/config.hpp"

namespace blockhess {

// n values of type U (the backend's T by default; a loss's classes or an embedding's ids are
// int64), uninitialised: every user writes them before it reads them. Resizing keeps the contents
// while the storage is large enough and the backend the same (a node's tangent scratch, written in
// one pass and read in the next); growing past it starts afresh.
template <class T, class U = T>
class BackendBuffer {
  static_assert(alignof(U) <= alignof(std::max_align_t), "backend storage is aligned for any scalar");

 public:
  BackendBuffer() = default;
  BackendBuffer(const Backend<T>& backend, index_t n) { resize(backend, n); }
  BackendBuffer(BackendBuffer&& other) noexcept { swap(other); }
  BackendBuffer& operator=(BackendBuffer&& other) noexcept {
    BackendBuffer(std::move(other)).swap(*this);
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  ~BackendBuffer() {
    if (data_) backend_->release(data_, words(capacity_));
  }

  void resize(const Backend<T>& backend, index_t n) {
    if (&backend != backend_ || n > capacity_) {
      BackendBuffer fresh;
      fresh.backend_ = &backend;
      fresh.data_ = n > 0 ? backend.allocate(words(n)) : nullptr;
      fresh.capacity_ = n;
      swap(fresh);
    }
    size_ = n;
  }
  void clear() { size_ = 0; }

  // n values from the host's memory: resized to n and uploaded.
  void assign(const Backend<T>& backend, const U* host, index_t n) {
    resize(backend, n);
    if (n > 0) backend.upload(data(), host, static_cast<std::size_t>(n) * sizeof(U));
  }

  U* data() { return reinterpret_cast<U*>(data_); }
  const U* data() const { return reinterpret_cast<const U*>(data_); }
  index_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Entry k, read on the host: host-addressable backends only (the engine's curvature).
  const U& operator[](index_t k) const { return data()[k]; }

 private:
  // The backend's values that hold n of U.
  static index_t words(index_t n) {
    return (n * static_cast<index_t>(sizeof(U)) + static_cast<index_t>(sizeof(T)) - 1) / static_cast<index_t>(sizeof(T));
  }

  void swap(BackendBuffer& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(capacity_, other.capacity_);
  }

  const Backend<T>* backend_ = nullptr;
  T* data_ = nullptr;
  index_t size_ = 0, capacity_ = 0;
};

// n values of type U in `backend`'s memory, readable on the host: the values themselves where the
// host addresses that memory, else a copy (a few values a token: a norm's scales, a loss's classes).
template <class U, class T>
class HostView {
 public:
  HostView(const Backend<T>& backend, const U* values, index_t n) : data_(values) {
    if (backend.host_addressable() || n <= 0) return;
    copy_.resize(static_cast<std::size_t>(n));
    backend.download(copy_.data(), values, static_cast<std::size_t>(n) * sizeof(U));
    data_ = copy_.data();
  }
  const U* data() const { return data_; }

 private:
  std::vector<U> copy_;
  const U* data_;
};

}  // namespace blockhess
