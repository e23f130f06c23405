// Plain C++ view of the CUDA runtime for the bindings: no CUDA headers leak out of cuda/.
#pragma once

#include <cstddef>
#include <cstdint>

namespace blockhess::cuda {

// Number of visible CUDA devices; 0 when there is no GPU or no driver (never throws for that).
int device_count();
// Blocks until all work queued on `stream` is done; throws std::runtime_error on a CUDA error.
void synchronize(std::uintptr_t stream);

// Device memory in stream order (cudaMallocAsync): usable by work queued on `stream` after the
// call, returned to the pool once the work queued before release() is done.
void* allocate(std::size_t bytes, std::uintptr_t stream);
void release(void* p, std::uintptr_t stream) noexcept;
// Host (pageable) -> device, in stream order. The host buffer may be reused as soon as this
// returns: a copy from pageable memory is staged before the call returns (the CUDA runtime's
// synchronisation rules for pageable transfers).
void copy_to_device(void* dst, const void* src, std::size_t bytes, std::uintptr_t stream);
// Device -> host, after the work queued on `stream`; returns when the bytes are there.
void copy_to_host(void* dst, const void* src, std::size_t bytes, std::uintptr_t stream);
// rows rows of width bytes, device -> device, each row `pitch` bytes after the previous one in
// its array, in stream order.
void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
               std::size_t rows, std::uintptr_t stream);
// bytes of device memory = 0, in stream order.
void fill_zero(void* p, std::size_t bytes, std::uintptr_t stream);

// A device array of n T, owned: allocated and released in the order of `stream`.
template <class T>
class DeviceArray {
 public:
  DeviceArray(std::size_t n, std::uintptr_t stream)
      : data_(n ? static_cast<T*>(allocate(n * sizeof(T), stream)) : nullptr), stream_(stream) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (data_) release(data_, stream_);
  }
  T* data() const { return data_; }
  // The first n entries = host[0, n).
  void upload(const T* host, std::size_t n) { copy_to_device(data_, host, n * sizeof(T), stream_); }

 private:
  T* data_;
  std::uintptr_t stream_;
};

}  // namespace blockhess::cuda
