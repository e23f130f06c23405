// Row softmax kernels. Entries come from cpp/include/blockhess/softmax.hpp: hessian_entry is called
// directly (BLOCKHESS_HD), the Jacobian / contraction / VJP entries repeat jacobian_row,
// hessian_contract_row and vjp_row's expressions, so GPU and CPU agree to rounding.
#include "blockhess/cuda/softmax.hpp"

#include "blockhess/softmax.hpp"
#include "common.cuh"

namespace blockhess::cuda::softmax {
namespace {

using detail::block_sum;
using detail::shared_array;

template <class T>
__device__ void load_row(const T* src, index_t n, T* dst) {
  for (index_t k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
  __syncthreads();
}

template <class T>
__device__ __forceinline__ T jacobian_entry(const T* a, index_t j, index_t k) {
  return a[j] * ((j == k ? T(1) : T(0)) - a[k]);
}

template <class T>
__global__ void forward_kernel(const T* Tm, index_t m, index_t n, T* A) {
  T* a = shared_array<T>();
  __shared__ T scratch[32];
  for (index_t i = blockIdx.x; i < m; i += gridDim.x) {
    detail::block_softmax_row(Tm + i * n, n, a, scratch);
    for (index_t k = threadIdx.x; k < n; k += blockDim.x) A[i * n + k] = a[k];
    __syncthreads();
  }
}

// Block (row i, tile of j): J[i, j, :] (blocks) or dense rows i n + j (dense, zeros elsewhere).
template <class T, bool dense>
__global__ void jacobian_kernel(const T* A, index_t m, index_t n, T* J, index_t rows_per_tile) {
  T* a = shared_array<T>();
  const index_t N = m * n, width = dense ? N : n;
  const index_t j0 = blockIdx.y * rows_per_tile;
  const index_t j1 = j0 + rows_per_tile < n ? j0 + rows_per_tile : n;
  for (index_t i = blockIdx.x; i < m; i += gridDim.x) {
    load_row(A + i * n, n, a);
    for (index_t j = j0; j < j1; ++j) {
      T* row = J + (i * n + j) * width;
      if (dense) {
        for (index_t c = threadIdx.x; c < N; c += blockDim.x) {
          const index_t k = c - i * n;
          row[c] = (k >= 0 && k < n) ? jacobian_entry(a, j, k) : T(0);
        }
      } else {
        for (index_t k = threadIdx.x; k < n; k += blockDim.x) row[k] = jacobian_entry(a, j, k);
      }
    }
    __syncthreads();
  }
}

// Block (row i, tile of (j, k) pairs): H[i, j, k, :], coalesced over l.
template <class T>
__global__ void hessian_blocks_kernel(const T* A, index_t m, index_t n, T* H, index_t pairs_per_tile) {
  T* a = shared_array<T>();
  const index_t p0 = blockIdx.y * pairs_per_tile;
  const index_t p1 = p0 + pairs_per_tile < n * n ? p0 + pairs_per_tile : n * n;
  for (index_t i = blockIdx.x; i < m; i += gridDim.x) {
    load_row(A + i * n, n, a);
    for (index_t p = p0; p < p1; ++p) {
      const index_t j = p / n, k = p - j * n;
      T* row = H + (i * n * n + p) * n;
      for (index_t l = threadIdx.x; l < n; l += blockDim.x)
        row[l] = blockhess::softmax::hessian_entry(a, j, k < l ? k : l, k < l ? l : k);
    }
    __syncthreads();
  }
}

// One block per dense row R = o N + p: zeros unless o and p are in the same row of T.
template <class T>
__global__ void hessian_dense_kernel(const T* A, index_t m, index_t n, T* H) {
  T* a = shared_array<T>();
  const index_t N = m * n;
  index_t cached = -1;
  for (index_t R = blockIdx.x; R < N * N; R += gridDim.x) {
    const index_t o = R / N, p = R - o * N;
    const index_t i = o / n, i2 = p / n;
    T* row = H + R * N;
    if (i != i2) {
      for (index_t q = threadIdx.x; q < N; q += blockDim.x) row[q] = T(0);
      continue;
    }
    if (i != cached) {  // block-uniform
      __syncthreads();
      load_row(A + i * n, n, a);
      cached = i;
    }
    const index_t j = o - i * n, k = p - i * n;
    for (index_t q = threadIdx.x; q < N; q += blockDim.x) {
      const index_t l = q - i * n;
      row[q] = (l >= 0 && l < n) ? blockhess::softmax::hessian_entry(a, j, k < l ? k : l, k < l ? l : k) : T(0);
    }
  }
}

// Block (row i, tile of k): C[i, k, :]; a and w = a (g - a.g) in shared memory.
template <class T>
__global__ void hessian_contract_kernel(const T* A, const T* G, index_t m, index_t n, T* C, index_t rows_per_tile) {
  T* a = shared_array<T>();
  T* w = a + n;
  __shared__ T scratch[32];
  const index_t k0 = blockIdx.y * rows_per_tile;
  const index_t k1 = k0 + rows_per_tile < n ? k0 + rows_per_tile : n;
  for (index_t i = blockIdx.x; i < m; i += gridDim.x) {
    T part = 0;
    for (index_t k = threadIdx.x; k < n; k += blockDim.x) {
      const T ak = A[i * n + k], gk = G[i * n + k];
      a[k] = ak;
      w[k] = gk;
      part += ak * gk;
    }
    const T ag = block_sum(part, scratch);
    for (index_t k = threadIdx.x; k < n; k += blockDim.x) w[k] = a[k] * (w[k] - ag);
    __syncthreads();
    for (index_t k = k0; k < k1; ++k) {
      T* row = C + (i * n + k) * n;
      for (index_t l = threadIdx.x; l < n; l += blockDim.x) {
        const index_t lo = k < l ? k : l, hi = k < l ? l : k;
        row[l] = (lo == hi ? w[lo] : T(0)) - a[lo] * w[hi] - w[lo] * a[hi];
      }
    }
    __syncthreads();
  }
}

template <class T>
__global__ void vjp_kernel(const T* A, const T* G, index_t m, index_t n, T* out) {
  __shared__ T scratch[32];
  for (index_t i = blockIdx.x; i < m; i += gridDim.x) {
    T part = 0;
    for (index_t k = threadIdx.x; k < n; k += blockDim.x) part += A[i * n + k] * G[i * n + k];
    const T ag = block_sum(part, scratch);
    for (index_t k = threadIdx.x; k < n; k += blockDim.x) out[i * n + k] = A[i * n + k] * (G[i * n + k] - ag);
  }
}

void check_sizes(index_t m, index_t n, const char* what) {
  detail::require(m >= 1 && n >= 1, std::string(what) + ": need m >= 1 and n >= 1, got m=" + std::to_string(m) +
                                        ", n=" + std::to_string(n));
}

}  // namespace

template <class T>
void forward(const T* Tm, index_t m, index_t n, T* A, std::uintptr_t stream) {
  check_sizes(m, n, "softmax forward");
  forward_kernel<T><<<detail::grid_x(m), detail::row_threads(n), detail::row_smem<T>(n, 1, "softmax"),
                      detail::as_stream(stream)>>>(Tm, m, n, A);
  detail::check_launch("softmax forward");
}

template <class T>
void jacobian_blocks(const T* A, index_t m, index_t n, T* J, std::uintptr_t stream) {
  check_sizes(m, n, "softmax jacobian_blocks");
  const auto tiles = detail::tiling(n, (4096 + n - 1) / n);
  jacobian_kernel<T, false><<<dim3(detail::grid_x(m), tiles.tiles), detail::row_threads(n),
                              detail::row_smem<T>(n, 1, "softmax"), detail::as_stream(stream)>>>(A, m, n, J,
                                                                                               tiles.per_tile);
  detail::check_launch("softmax jacobian_blocks");
}

template <class T>
void jacobian_dense(const T* A, index_t m, index_t n, T* J, std::uintptr_t stream) {
  check_sizes(m, n, "softmax jacobian_dense");
  const auto tiles = detail::tiling(n, (4096 + m * n - 1) / (m * n));
  jacobian_kernel<T, true><<<dim3(detail::grid_x(m), tiles.tiles), detail::kMaxThreads,
                             detail::row_smem<T>(n, 1, "softmax"), detail::as_stream(stream)>>>(A, m, n, J,
                                                                                              tiles.per_tile);
  detail::check_launch("softmax jacobian_dense");
}

template <class T>
void hessian_blocks(const T* A, index_t m, index_t n, T* H, std::uintptr_t stream) {
  check_sizes(m, n, "softmax hessian_blocks");
  const auto tiles = detail::tiling(n * n, (4096 + n - 1) / n);
  hessian_blocks_kernel<T><<<dim3(detail::grid_x(m), tiles.tiles), detail::row_threads(n),
                             detail::row_smem<T>(n, 1, "softmax"), detail::as_stream(stream)>>>(A, m, n, H,
                                                                                              tiles.per_tile);
  detail::check_launch("softmax hessian_blocks");
}

template <class T>
void hessian_dense(const T* A, index_t m, index_t n, T* H, std::uintptr_t stream) {
  check_sizes(m, n, "softmax hessian_dense");
  const index_t N = m * n;
  hessian_dense_kernel<T><<<detail::grid_x(N * N), detail::kMaxThreads, detail::row_smem<T>(n, 1, "softmax"),
                            detail::as_stream(stream)>>>(A, m, n, H);
  detail::check_launch("softmax hessian_dense");
}

template <class T>
void hessian_contract(const T* A, const T* G, index_t m, index_t n, T* C, std::uintptr_t stream) {
  check_sizes(m, n, "softmax hessian_contract");
  const auto tiles = detail::tiling(n, (4096 + n - 1) / n);
  hessian_contract_kernel<T><<<dim3(detail::grid_x(m), tiles.tiles), detail::row_threads(n),
                               detail::row_smem<T>(n, 2, "softmax"), detail::as_stream(stream)>>>(A, G, m, n, C,
                                                                                                tiles.per_tile);
  detail::check_launch("softmax hessian_contract");
}

template <class T>
void vjp(const T* A, const T* G, index_t m, index_t n, T* out, std::uintptr_t stream) {
  check_sizes(m, n, "softmax vjp");
  vjp_kernel<T><<<detail::grid_x(m), detail::row_threads(n), 0, detail::as_stream(stream)>>>(A, G, m, n, out);
  detail::check_launch("softmax vjp");
}

#define BLOCKHESS_INSTANTIATE(T)                                                                \
  template void forward<T>(const T*, index_t, index_t, T*, std::uintptr_t);                     \
  template void jacobian_blocks<T>(const T*, index_t, index_t, T*, std::uintptr_t);             \
  template void jacobian_dense<T>(const T*, index_t, index_t, T*, std::uintptr_t);              \
  template void hessian_blocks<T>(const T*, index_t, index_t, T*, std::uintptr_t);              \
  template void hessian_dense<T>(const T*, index_t, index_t, T*, std::uintptr_t);               \
  template void hessian_contract<T>(const T*, const T*, index_t, index_t, T*, std::uintptr_t);  \
  template void vjp<T>(const T*, const T*, index_t, index_t, T*, std::uintptr_t);
BLOCKHESS_INSTANTIATE(float)
BLOCKHESS_INSTANTIATE(double)
#undef BLOCKHESS_INSTANTIATE

}  // namespace blockhess::cuda::softmax
