// LayerNorm kernels. Every entry comes from the BLOCKHESS_HD entry functions of
// cpp/include/blockhess/layernorm.hpp (jacobian_entry, hessian_entry, hessian_contract_entry) that
// the CPU rows call too, so GPU and CPU agree to rounding; the row statistics (block reductions,
// another summation order) come from block_normalize_row.
#include "blockhess/cuda/layernorm.hpp"

#include "blockhess/layernorm.hpp"
#include "common.cuh"

namespace blockhess::cuda::layernorm {
namespace {

using blockhess::layernorm::hessian_contract_entry;
using blockhess::layernorm::hessian_entry;
using blockhess::layernorm::jacobian_entry;
using detail::block_normalize_row;
using detail::block_sum;
using detail::shared_array;

template <class T>
__device__ __forceinline__ T gamma_at(const T* gamma, index_t a) {
  return gamma ? gamma[a] : T(1);
}

template <class T>
__global__ void forward_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* beta, T* Z,
                               T* sigma_out) {
  T* y = shared_array<T>();
  __shared__ T scratch[32];
  for (index_t i = blockIdx.x; i < L; i += gridDim.x) {
    const T sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
    if (sigma_out && threadIdx.x == 0) sigma_out[i] = sigma;
    T* z = Z + i * d;
    for (index_t a = threadIdx.x; a < d; a += blockDim.x)
      z[a] = gamma_at(gamma, a) * y[a] + (beta ? beta[a] : T(0));
    __syncthreads();  // y is rewritten for the next row
  }
}

// Block (row i, tile): output rows a in [a0, a0 + rows_per_tile) of slab i, coalesced over b.
template <class T, Slab kind>
__global__ void slab_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, T* out, T* sigma_out,
                            index_t rows_per_tile) {
  T* y = shared_array<T>();
  __shared__ T scratch[32];
  const T inv_d = T(1) / static_cast<T>(d);
  const index_t a0 = blockIdx.y * rows_per_tile;
  const index_t a1 = a0 + rows_per_tile < d ? a0 + rows_per_tile : d;
  for (index_t i = blockIdx.x; i < L; i += gridDim.x) {
    const T sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
    if (sigma_out && blockIdx.y == 0 && threadIdx.x == 0) sigma_out[i] = sigma;
    T* slab = out + i * d * d;
    for (index_t a = a0; a < a1; ++a) {
      T* row = slab + a * d;
      if (kind == Slab::jacobian) {
        const T scale = gamma_at(gamma, a) / sigma;
        for (index_t b = threadIdx.x; b < d; b += blockDim.x) row[b] = jacobian_entry(y, scale, inv_d, a, b);
      } else if (kind == Slab::gamma) {
        for (index_t b = threadIdx.x; b < d; b += blockDim.x) row[b] = a == b ? y[a] : T(0);
      } else {
        for (index_t b = threadIdx.x; b < d; b += blockDim.x) row[b] = a == b ? T(1) : T(0);
      }
    }
    __syncthreads();
  }
}

// Block (row i, tile): full dense rows i d + a for a in the tile (zeros outside the diagonal block).
template <class T>
__global__ void jacobian_dense_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, T* J, T* sigma_out,
                                      index_t rows_per_tile) {
  T* y = shared_array<T>();
  __shared__ T scratch[32];
  const T inv_d = T(1) / static_cast<T>(d);
  const index_t n = L * d;
  const index_t a0 = blockIdx.y * rows_per_tile;
  const index_t a1 = a0 + rows_per_tile < d ? a0 + rows_per_tile : d;
  for (index_t i = blockIdx.x; i < L; i += gridDim.x) {
    const T sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
    if (sigma_out && blockIdx.y == 0 && threadIdx.x == 0) sigma_out[i] = sigma;
    for (index_t a = a0; a < a1; ++a) {
      const T scale = gamma_at(gamma, a) / sigma;
      T* row = J + (i * d + a) * n;
      for (index_t c = threadIdx.x; c < n; c += blockDim.x) {
        const index_t b = c - i * d;
        row[c] = (b >= 0 && b < d) ? jacobian_entry(y, scale, inv_d, a, b) : T(0);
      }
    }
    __syncthreads();
  }
}

// Block (row i, tile of (a, b) pairs): H[i, a, b, :], coalesced over c.
template <class T>
__global__ void hessian_blocks_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma_out,
                                      index_t pairs_per_tile) {
  T* y = shared_array<T>();
  __shared__ T scratch[32];
  const T inv_d = T(1) / static_cast<T>(d);
  const index_t p0 = blockIdx.y * pairs_per_tile;
  const index_t p1 = p0 + pairs_per_tile < d * d ? p0 + pairs_per_tile : d * d;
  for (index_t i = blockIdx.x; i < L; i += gridDim.x) {
    const T sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
    if (sigma_out && blockIdx.y == 0 && threadIdx.x == 0) sigma_out[i] = sigma;
    const T pref = -inv_d / sigma / sigma;
    for (index_t p = p0; p < p1; ++p) {
      const index_t a = p / d, b = p - a * d;
      const T ga = gamma_at(gamma, a) * pref;
      T* row = H + (i * d * d + p) * d;
      for (index_t c = threadIdx.x; c < d; c += blockDim.x) {
        const index_t lo = b < c ? b : c, hi = b < c ? c : b;
        row[c] = hessian_entry(y, ga, inv_d, a, lo, hi);
      }
    }
    __syncthreads();
  }
}

// One block per dense row R = o n + p (grid-stride): zeros unless o and p are in the same token.
template <class T>
__global__ void hessian_dense_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma_out) {
  T* y = shared_array<T>();
  __shared__ T scratch[32];
  const T inv_d = T(1) / static_cast<T>(d);
  const index_t n = L * d;
  index_t cached = -1;
  T sigma = 0;
  for (index_t R = blockIdx.x; R < n * n; R += gridDim.x) {
    const index_t o = R / n, p = R - o * n;
    const index_t i = o / d, j = p / d;
    T* row = H + R * n;
    if (i != j) {
      for (index_t q = threadIdx.x; q < n; q += blockDim.x) row[q] = T(0);
      continue;
    }
    if (i != cached) {  // block-uniform
      __syncthreads();  // y of the previous token may still be read
      sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
      cached = i;
    }
    const index_t a = o - i * d, b = p - i * d;
    if (sigma_out && a == 0 && b == 0 && threadIdx.x == 0) sigma_out[i] = sigma;
    const T ga = gamma_at(gamma, a) * (-inv_d / sigma / sigma);
    for (index_t q = threadIdx.x; q < n; q += blockDim.x) {
      const index_t c = q - i * d;
      T v = T(0);
      if (c >= 0 && c < d) {
        const index_t lo = b < c ? b : c, hi = b < c ? c : b;
        v = hessian_entry(y, ga, inv_d, a, lo, hi);
      }
      row[q] = v;
    }
  }
}

// Block (row i, tile of b): C[i, b, :] (layernorm::hessian_contract_row), coalesced over c.
template <class T>
__global__ void hessian_contract_kernel(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* G, T* C,
                                        T* sigma_out, index_t rows_per_tile) {
  T* y = shared_array<T>();
  T* gp = y + d;  // g * gamma
  __shared__ T scratch[32];
  const T inv_d = T(1) / static_cast<T>(d);
  const index_t b0 = blockIdx.y * rows_per_tile;
  const index_t b1 = b0 + rows_per_tile < d ? b0 + rows_per_tile : d;
  for (index_t i = blockIdx.x; i < L; i += gridDim.x) {
    const T sigma = block_normalize_row(X + i * d, d, eps, y, scratch);
    if (sigma_out && blockIdx.y == 0 && threadIdx.x == 0) sigma_out[i] = sigma;
    T gs = 0, ys = 0;
    for (index_t a = threadIdx.x; a < d; a += blockDim.x) {
      const T ga = G[i * d + a] * gamma_at(gamma, a);
      gp[a] = ga;
      gs += ga;
      ys += ga * y[a];
    }
    const T gmean = block_sum(gs, scratch) * inv_d;  // block_sum ends with a barrier: gp is visible
    const T s = block_sum(ys, scratch);
    const T pref = -inv_d / sigma / sigma;
    for (index_t b = b0; b < b1; ++b) {
      T* row = C + (i * d + b) * d;
      for (index_t c = threadIdx.x; c < d; c += blockDim.x) {
        const index_t lo = b < c ? b : c, hi = b < c ? c : b;
        row[c] = hessian_contract_entry(y, gp[lo] - gmean, gp[hi] - gmean, s, pref, inv_d, lo, hi);
      }
    }
    __syncthreads();
  }
}

void check_sizes(index_t L, index_t d, const char* what) {
  detail::require(L >= 1 && d >= 1, std::string(what) + ": need L >= 1 and d >= 1, got L=" + std::to_string(L) +
                                        ", d=" + std::to_string(d));
}

}  // namespace

template <class T>
void forward(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* beta, T* Z, T* sigma,
             std::uintptr_t stream) {
  check_sizes(L, d, "layernorm forward");
  const size_t smem = detail::row_smem<T>(d, 1, "layernorm");
  forward_kernel<T><<<detail::grid_x(L), detail::row_threads(d), smem, detail::as_stream(stream)>>>(
      X, L, d, eps, gamma, beta, Z, sigma);
  detail::check_launch("layernorm forward");
}

template <class T>
void jacobian_blocks(const T* X, index_t L, index_t d, T eps, const T* gamma, Slab kind, T* out, T* sigma,
                     std::uintptr_t stream, index_t tile_elems) {
  check_sizes(L, d, "layernorm jacobian_blocks");
  const size_t smem = detail::row_smem<T>(d, 1, "layernorm");
  const auto tiles = detail::tiling(d, ((tile_elems > 0 ? tile_elems : 4096) + d - 1) / d);
  const dim3 grid(detail::grid_x(L), tiles.tiles);
  const int threads = detail::row_threads(d);
  const cudaStream_t s = detail::as_stream(stream);
  switch (kind) {
    case Slab::jacobian:
      slab_kernel<T, Slab::jacobian><<<grid, threads, smem, s>>>(X, L, d, eps, gamma, out, sigma, tiles.per_tile);
      break;
    case Slab::gamma:
      slab_kernel<T, Slab::gamma><<<grid, threads, smem, s>>>(X, L, d, eps, gamma, out, sigma, tiles.per_tile);
      break;
    case Slab::beta:
      slab_kernel<T, Slab::beta><<<grid, threads, smem, s>>>(X, L, d, eps, gamma, out, sigma, tiles.per_tile);
      break;
    default: detail::require(false, "layernorm jacobian_blocks: unknown slab kind");
  }
  detail::check_launch("layernorm jacobian_blocks");
}

template <class T>
void jacobian_dense(const T* X, index_t L, index_t d, T eps, const T* gamma, T* J, T* sigma, std::uintptr_t stream) {
  check_sizes(L, d, "layernorm jacobian_dense");
  const size_t smem = detail::row_smem<T>(d, 1, "layernorm");
  const auto tiles = detail::tiling(d, (4096 + L * d - 1) / (L * d));
  jacobian_dense_kernel<T><<<dim3(detail::grid_x(L), tiles.tiles), detail::kMaxThreads, smem,
                             detail::as_stream(stream)>>>(X, L, d, eps, gamma, J, sigma, tiles.per_tile);
  detail::check_launch("layernorm jacobian_dense");
}

template <class T>
void hessian_blocks(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma, std::uintptr_t stream) {
  check_sizes(L, d, "layernorm hessian_blocks");
  const size_t smem = detail::row_smem<T>(d, 1, "layernorm");
  const auto tiles = detail::tiling(d * d, (4096 + d - 1) / d);
  hessian_blocks_kernel<T><<<dim3(detail::grid_x(L), tiles.tiles), detail::row_threads(d), smem,
                             detail::as_stream(stream)>>>(X, L, d, eps, gamma, H, sigma, tiles.per_tile);
  detail::check_launch("layernorm hessian_blocks");
}

template <class T>
void hessian_dense(const T* X, index_t L, index_t d, T eps, const T* gamma, T* H, T* sigma, std::uintptr_t stream) {
  check_sizes(L, d, "layernorm hessian_dense");
  const size_t smem = detail::row_smem<T>(d, 1, "layernorm");
  const index_t n = L * d;
  hessian_dense_kernel<T><<<detail::grid_x(n * n), detail::kMaxThreads, smem, detail::as_stream(stream)>>>(
      X, L, d, eps, gamma, H, sigma);
  detail::check_launch("layernorm hessian_dense");
}

template <class T>
void hessian_contract(const T* X, index_t L, index_t d, T eps, const T* gamma, const T* G, T* C, T* sigma,
                      std::uintptr_t stream) {
  check_sizes(L, d, "layernorm hessian_contract");
  const size_t smem = detail::row_smem<T>(d, 2, "layernorm");
  const auto tiles = detail::tiling(d, (4096 + d - 1) / d);
  hessian_contract_kernel<T><<<dim3(detail::grid_x(L), tiles.tiles), detail::row_threads(d), smem,
                               detail::as_stream(stream)>>>(X, L, d, eps, gamma, G, C, sigma, tiles.per_tile);
  detail::check_launch("layernorm hessian_contract");
}

#define BLOCKHESS_INSTANTIATE(T)                                                                                   \
  template void forward<T>(const T*, index_t, index_t, T, const T*, const T*, T*, T*, std::uintptr_t);            \
  template void jacobian_blocks<T>(const T*, index_t, index_t, T, const T*, Slab, T*, T*, std::uintptr_t,         \
                                   index_t);                                                                      \
  template void jacobian_dense<T>(const T*, index_t, index_t, T, const T*, T*, T*, std::uintptr_t);               \
  template void hessian_blocks<T>(const T*, index_t, index_t, T, const T*, T*, T*, std::uintptr_t);               \
  template void hessian_dense<T>(const T*, index_t, index_t, T, const T*, T*, T*, std::uintptr_t);                \
  template void hessian_contract<T>(const T*, index_t, index_t, T, const T*, const T*, T*, T*, std::uintptr_t);
BLOCKHESS_INSTANTIATE(float)
BLOCKHESS_INSTANTIATE(double)
#undef BLOCKHESS_INSTANTIATE

}  // namespace blockhess::cuda::layernorm
