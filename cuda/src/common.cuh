// Private helpers shared by the .cu files: error checks, launch geometry, block reductions and the
// block-cooperative row normalisations (LayerNorm, softmax) that the per-row kernels start with.
// Nothing here is visible outside cuda/ (the public launcher headers contain no CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/math.hpp"

namespace blockhess::cuda::detail {

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Throws std::runtime_error (RuntimeError in Python) after a failed launch or API call.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("blockhess CUDA error in ") + what + ": " + cudaGetErrorString(err));
}
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("blockhess CUDA: " + message);
}

constexpr int kMaxThreads = 256;
constexpr unsigned kMaxGridX = 1u << 20;  // grid-stride loops cover anything beyond this
constexpr unsigned kMaxGridY = 65535u;

// Threads for a per-row kernel over rows of length n: a multiple of 32 (full-warp shuffles).
inline int row_threads(index_t n) {
  const index_t t = ((n + 31) / 32) * 32;
  return static_cast<int>(std::min<index_t>(std::max<index_t>(t, 32), kMaxThreads));
}

// Blocks for an element-wise grid-stride kernel over `count` items.
inline unsigned elementwise_blocks(index_t count, int threads = kMaxThreads) {
  const index_t b = (count + threads - 1) / threads;
  return static_cast<unsigned>(std::max<index_t>(1, std::min<index_t>(b, kMaxGridX)));
}

inline unsigned grid_x(index_t rows) {
  return static_cast<unsigned>(std::max<index_t>(1, std::min<index_t>(rows, kMaxGridX)));
}

// Split `count` work items of one row into at most kMaxGridY tiles of about `target` items each.
struct Tiling {
  index_t per_tile;
  unsigned tiles;
};
inline Tiling tiling(index_t count, index_t target) {
  index_t per = std::max<index_t>(1, std::min<index_t>(target, count));
  per = std::max<index_t>(per, (count + kMaxGridY - 1) / kMaxGridY);
  return {per, static_cast<unsigned>((count + per - 1) / per)};
}

// Dynamic shared memory the per-row kernels need for `arrays` vectors of length n.
template <class T>
inline size_t row_smem(index_t n, int arrays, const char* what) {
  const size_t bytes = sizeof(T) * static_cast<size_t>(n) * static_cast<size_t>(arrays);
  require(bytes <= 48 * 1024, std::string(what) + ": rows of length " + std::to_string(n) +
                                  " are too long for the GPU kernels (at most " +
                                  std::to_string(48 * 1024 / (sizeof(T) * arrays)) + " for this dtype)");
  return bytes;
}

#if defined(__CUDACC__)

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}
template <class T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    const T w = __shfl_down_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Block-wide reductions (blockDim.x a multiple of 32); every thread gets the result. The order of
// the partial sums depends only on blockDim.x, so every block of a launch reduces a row to the same
// bits, which keeps tiles of one row consistent.
template <class T>
__device__ T block_sum(T v, T* scratch /* [32] shared */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T r = lane < nwarps ? scratch[lane] : T(0);
    r = warp_sum(r);
    if (lane == 0) scratch[0] = r;
  }
  __syncthreads();
  return scratch[0];
}
template <class T>
__device__ T block_max(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T r = lane < nwarps ? scratch[lane] : scratch[0];
    r = warp_max(r);
    if (lane == 0) scratch[0] = r;
  }
  __syncthreads();
  return scratch[0];
}

// y = (x - mean) / sigma for one row, sigma = sqrt(var + eps) with the population variance: the
// scale-safe arithmetic of layernorm::normalize_row (row_sigma is shared), with block-parallel
// max and sums. Returns 0 for a row that is constant up to rounding with eps == 0. y lives in
// shared memory.
template <class T>
__device__ T block_normalize_row(const T* x, index_t d, T eps, T* y, T* scratch) {
  T top = 0;
  for (index_t a = threadIdx.x; a < d; a += blockDim.x) {
    const T v = x[a];
    y[a] = v;
    top = ::blockhess::math::abs(v) > top ? ::blockhess::math::abs(v) : top;
  }
  const int k = ::blockhess::math::exponent(block_max(top, scratch));
  const ::blockhess::layernorm::Pow2Scale<T> scaled(k);
  T s = 0;
  for (index_t a = threadIdx.x; a < d; a += blockDim.x) {
    const T v = scaled(y[a]);
    y[a] = v;
    s += v;
  }
  const T mean = block_sum(s, scratch) / static_cast<T>(d);
  T q = 0;
  for (index_t a = threadIdx.x; a < d; a += blockDim.x) {
    const T m = y[a] - mean;
    y[a] = m;
    q += m * m;
  }
  T divisor = 0;
  const T sigma = ::blockhess::layernorm::row_sigma(block_sum(q, scratch) / static_cast<T>(d), k, eps, d, &divisor);
  for (index_t a = threadIdx.x; a < d; a += blockDim.x) y[a] /= divisor;
  __syncthreads();
  return sigma;
}

// a = softmax(t) for one row (max-shifted), the arithmetic of softmax::forward_row. a in shared memory.
template <class T>
__device__ void block_softmax_row(const T* t, index_t n, T* a, T* scratch) {
  T top = t[0];
  for (index_t k = threadIdx.x; k < n; k += blockDim.x) {
    const T v = t[k];
    a[k] = v;
    top = v > top ? v : top;
  }
  top = block_max(top, scratch);
  T s = 0;
  for (index_t k = threadIdx.x; k < n; k += blockDim.x) {
    const T e = exp(a[k] - top);
    a[k] = e;
    s += e;
  }
  const T inv = T(1) / block_sum(s, scratch);
  for (index_t k = threadIdx.x; k < n; k += blockDim.x) a[k] *= inv;
  __syncthreads();
}

// Shared memory as T*, whatever T the kernel is instantiated for.
template <class T>
__device__ __forceinline__ T* shared_array() {
  extern __shared__ __align__(16) unsigned char blockhess_smem[];
  return reinterpret_cast<T*>(blockhess_smem);
}

#endif  // __CUDACC__

}  // namespace blockhess::cuda::detail
