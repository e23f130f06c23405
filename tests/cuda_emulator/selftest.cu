// Kernels with known defects (and one without), for tests/test_kernel_emulator.py: the CPU
// emulator must run the correct one right and flag every defect. Plain C entry points for ctypes;
// each returns the launch's error code.
#include <cuda_runtime.h>

namespace {

__device__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Correct: out[b] = sum of x, by warp shuffles and a shared-memory pass.
__global__ void block_sum_kernel(const double* x, int n, double* out) {
  __shared__ double partial[32];
  double v = 0;
  for (int k = threadIdx.x; k < n; k += blockDim.x) v += x[k];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (unsigned w = 0; w < (blockDim.x >> 5); ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

// Defect: every thread reads what thread 0 wrote, without a __syncthreads() in between.
__global__ void missing_barrier_kernel(double* out) {
  __shared__ double value;
  if (threadIdx.x == 0) value = 1.0 + blockIdx.x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// Defect: two block reductions through one shared array, without the barrier that keeps the
// second from overwriting the first's partial sums before every warp has read them.
__global__ void reused_scratch_kernel(double* out) {
  __shared__ double scratch[32];
  double first = 0;
  for (int round = 0; round < 2; ++round) {
    const double v = warp_sum(1.0 + round);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    double total = 0;
    for (unsigned w = 0; w < (blockDim.x >> 5); ++w) total += scratch[w];
    if (round == 0) first = total;  // a __syncthreads() belongs here
  }
  out[threadIdx.x] = first;
}

// Defect: a full-warp shuffle after lanes 20..31 have returned.
__global__ void exited_lanes_kernel(double* out) {
  if (threadIdx.x >= 20) return;
  out[threadIdx.x] = warp_sum(1.0);
}

// Correct only for a dynamic shared array that is written before it is read; this one is not.
__global__ void unwritten_shared_kernel(double* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  out[threadIdx.x] = reinterpret_cast<double*>(smem)[threadIdx.x];
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT int block_sum(const double* x, int n, int threads, double* out) {
  block_sum_kernel<<<2, threads>>>(x, n, out);
  return cudaGetLastError();
}

EXPORT int missing_barrier(int blocks, int threads, double* out) {
  missing_barrier_kernel<<<blocks, threads>>>(out);
  return cudaGetLastError();
}

EXPORT int reused_scratch(int threads, double* out) {
  reused_scratch_kernel<<<1, threads>>>(out);
  return cudaGetLastError();
}

EXPORT int exited_lanes(double* out) {
  exited_lanes_kernel<<<1, 32>>>(out);
  return cudaGetLastError();
}

EXPORT int block_of(unsigned x, unsigned y, unsigned z, double* out) {
  unwritten_shared_kernel<<<1, dim3(x, y, z)>>>(out);
  return cudaGetLastError();
}

EXPORT int shared_bytes(unsigned bytes, double* out) {
  unwritten_shared_kernel<<<1, 4, bytes>>>(out);
  return cudaGetLastError();
}

EXPORT const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
