#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "blockhess/cuda/runtime.hpp"
#include "common.cuh"

namespace blockhess::cuda {

using detail::as_stream;
using detail::check;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

void synchronize(std::uintptr_t stream) { check(cudaStreamSynchronize(as_stream(stream)), "synchronize"); }

void* allocate(std::size_t bytes, std::uintptr_t stream) {
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, as_stream(stream));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw std::runtime_error("CUDA: out of device memory allocating " + std::to_string(bytes) + " bytes of scratch");
  }
  check(err, "allocate");
  return p;
}

void release(void* p, std::uintptr_t stream) noexcept {
  if (cudaFreeAsync(p, as_stream(stream)) != cudaSuccess) cudaGetLastError();  // a destructor never throws
}

void copy_to_device(void* dst, const void* src, std::size_t bytes, std::uintptr_t stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)), "copy_to_device");
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, std::uintptr_t stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream)), "copy_to_host");
  synchronize(stream);
}

void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
               std::size_t rows, std::uintptr_t stream) {
  check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, as_stream(stream)),
        "copy_rows");
}

void fill_zero(void* p, std::size_t bytes, std::uintptr_t stream) {
  check(cudaMemsetAsync(p, 0, bytes, as_stream(stream)), "fill_zero");
}

}  // namespace blockhess::cuda
