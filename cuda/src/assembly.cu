// Structured assembly kernels (see cuda/include/blockhess/cuda/assembly.hpp). All element-wise:
// one thread block per output row (grid-stride), threads over the row, so writes are coalesced.
#include "blockhess/cuda/assembly.hpp"

#include <limits>

#include "common.cuh"

namespace blockhess::cuda::assembly {
namespace {

using detail::kMaxThreads;

// (o, r) of a flat parameter index; 32-bit arithmetic (the launchers check the sizes).
__device__ __forceinline__ void split_index(std::uint32_t flat, std::uint32_t n_second, bool vec_on_first,
                                           std::uint32_t& o, std::uint32_t& r) {
  const std::uint32_t hi = flat / n_second, lo = flat - hi * n_second;
  if (vec_on_first) {
    o = hi;
    r = lo;
  } else {
    r = hi;
    o = lo;
  }
}

template <class T>
__global__ void commute_kernel(const T* v, index_t m, index_t n, index_t cols, T* out) {
  const index_t total = m * n * cols;
  for (index_t e = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t r = e / cols, k = e - r * cols;
    const index_t i = r / n, j = r - i * n;
    out[e] = v[(j * m + i) * cols + k];
  }
}

template <class T>
__global__ void commutation_ones_kernel(index_t m, index_t n, T* K) {
  const index_t N = m * n;
  for (index_t r = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; r < N;
       r += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t i = r / n, j = r - i * n;
    K[r * N + j * m + i] = T(1);
  }
}

// A Split as the kernels use it: 32-bit sizes (the launchers check them) and the flat index.
struct SplitArgs {
  std::uint32_t size, n_second, n_vec, n_mat;
  bool vec_on_first;
  index_t stride, offset;

  // Row-major index in the parameter (or the block of its columns) of (vector index o, matrix index r).
  __device__ __forceinline__ index_t flat(std::uint32_t o, std::uint32_t r) const {
    return (vec_on_first ? static_cast<index_t>(o) * stride + r : static_cast<index_t>(r) * stride + o) + offset;
  }
};

// The iteration runs over the piece's own entries (k = its row-major index, decoded by
// split_index); flat() places each in H, so a head's block of columns lands at its stride.
template <class T>
__global__ void kron_accumulate_kernel(index_t tokens, SplitArgs si, const T* u, SplitArgs sj, const T* w,
                                       const T* G, T alpha, T* H, index_t ldH, bool upper_only) {
  const index_t gstride = static_cast<index_t>(si.n_mat) * sj.n_mat;
  for (std::uint32_t ki = blockIdx.x; ki < si.size; ki += gridDim.x) {
    std::uint32_t oi, ri;
    split_index(ki, si.n_second, si.vec_on_first, oi, ri);
    T* h = H + si.flat(oi, ri) * ldH;
    const std::uint32_t c0 = upper_only ? ki : 0u;
    for (std::uint32_t kj = c0 + blockIdx.y * blockDim.x + threadIdx.x; kj < sj.size; kj += gridDim.y * blockDim.x) {
      std::uint32_t oj, rj;
      split_index(kj, sj.n_second, sj.vec_on_first, oj, rj);
      const T* up = u + oi;
      const T* wp = w + oj;
      const T* gp = G + static_cast<index_t>(ri) * sj.n_mat + rj;
      T acc = 0;
      for (index_t t = 0; t < tokens; ++t) acc += up[t * si.n_vec] * wp[t * sj.n_vec] * gp[t * gstride];
      h[sj.flat(oj, rj)] += alpha * acc;
    }
  }
}

// One thread block per (oi, r) row of the piece i; threads over oj.
template <class T>
__global__ void kron_accumulate_diagonal_kernel(index_t tokens, SplitArgs si, const T* u, SplitArgs sj, const T* w,
                                                const T* D, T alpha, T* H, index_t ldH) {
  const std::uint32_t r_count = si.n_mat;
  const index_t rows = static_cast<index_t>(si.n_vec) * r_count;
  for (index_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::uint32_t oi = static_cast<std::uint32_t>(row / r_count), r = static_cast<std::uint32_t>(row % r_count);
    T* h = H + si.flat(oi, r) * ldH;
    for (std::uint32_t oj = blockIdx.y * blockDim.x + threadIdx.x; oj < sj.n_vec; oj += gridDim.y * blockDim.x) {
      T acc = 0;
      for (index_t t = 0; t < tokens; ++t)
        acc += u[t * si.n_vec + oi] * w[t * sj.n_vec + oj] * (D ? D[t * r_count + r] : T(1));
      h[sj.flat(oj, r)] += alpha * acc;
    }
  }
}

// One thread block per row i; threads over the columns j >= i.
template <class T>
__global__ void gram_upper_kernel(index_t rows, index_t n, const T* J, const T* K, T* H, index_t ld) {
  for (index_t i = blockIdx.x; i < n; i += gridDim.x) {
    for (index_t j = i + blockIdx.y * static_cast<index_t>(blockDim.x) + threadIdx.x; j < n;
         j += static_cast<index_t>(gridDim.y) * blockDim.x) {
      T acc = 0;
      for (index_t k = 0; k < rows; ++k) acc += J[k * n + i] * K[k * n + j];
      H[i * ld + j] += acc;
    }
  }
}

template <class T>
__global__ void flag_nonfinite_kernel(const T* H, index_t n, index_t ld, unsigned* flag) {
  const index_t total = n * n;
  bool bad = false;
  for (index_t e = blockIdx.x * static_cast<index_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const T v = H[(e / n) * ld + e % n];
    bad |= !(v - v == T(0));  // Inf - Inf and NaN - NaN are NaN
  }
  if (bad) atomicOr(flag, 1u);
}

constexpr int kTile = 32;

// Lower tile (bi, bj), bi >= bj: H[r, c] = H[c, r] for r > c, through a shared transpose tile.
template <class T>
__global__ void mirror_kernel(T* H, index_t n, index_t ld) {
  __shared__ T tile[kTile][kTile + 1];
  const index_t bi = blockIdx.y, bj = blockIdx.x;
  if (bi < bj) return;
  const int tx = threadIdx.x;
  for (int ty = threadIdx.y; ty < kTile; ty += blockDim.y) {
    const index_t c = bj * kTile + ty, r = bi * kTile + tx;  // source H[c, r] (upper), coalesced over r
    if (c < n && r < n) tile[ty][tx] = H[c * ld + r];
  }
  __syncthreads();
  for (int ty = threadIdx.y; ty < kTile; ty += blockDim.y) {
    const index_t r = bi * kTile + ty, c = bj * kTile + tx;
    if (r < n && c < n && r > c) H[r * ld + c] = tile[tx][ty];
  }
}

void require_u32(index_t n, const char* what) {
  detail::require(n >= 0 && n < static_cast<index_t>(std::numeric_limits<std::uint32_t>::max()),
                  std::string(what) + ": a dimension of " + std::to_string(n) + " is too large");
}

// Column tiles so that a row of ncols is covered by several blocks when it is long.
unsigned col_tiles(index_t ncols, index_t rows) {
  const index_t per_row = (ncols + kMaxThreads - 1) / kMaxThreads;
  // enough blocks to fill the GPU even with few rows, without exceeding the grid limit
  const index_t want = std::max<index_t>(1, std::min<index_t>(per_row, (4096 + rows - 1) / std::max<index_t>(rows, 1)));
  return static_cast<unsigned>(std::min<index_t>(want, detail::kMaxGridY));
}

index_t split_size(const Split& s) { return s.n_first * s.n_second; }
index_t n_vec(const Split& s) { return s.vec_on_first ? s.n_first : s.n_second; }
index_t n_mat(const Split& s) { return s.vec_on_first ? s.n_second : s.n_first; }

void check_split(const Split& s, const char* what) {
  detail::require(s.n_first >= 1 && s.n_second >= 1, std::string(what) + ": empty parameter split");
  require_u32(split_size(s), what);
}

}  // namespace

template <class T>
void commute(const T* v, index_t m, index_t n, index_t cols, T* out, std::uintptr_t stream) {
  detail::require(m >= 1 && n >= 1 && cols >= 1, "commute: m, n and cols must be >= 1");
  commute_kernel<T><<<detail::elementwise_blocks(m * n * cols), kMaxThreads, 0, detail::as_stream(stream)>>>(
      v, m, n, cols, out);
  detail::check_launch("commute");
}

template <class T>
void commutation_dense(index_t m, index_t n, T* K, std::uintptr_t stream) {
  detail::require(m >= 1 && n >= 1, "commutation_dense: m and n must be >= 1");
  const index_t N = m * n;
  const cudaStream_t s = detail::as_stream(stream);
  detail::check(cudaMemsetAsync(K, 0, sizeof(T) * static_cast<size_t>(N * N), s), "commutation_dense memset");
  commutation_ones_kernel<T><<<detail::elementwise_blocks(N), kMaxThreads, 0, s>>>(m, n, K);
  detail::check_launch("commutation_dense");
}

// Row stride of a split's parameter: 0 stands for the whole parameter (n_second).
index_t row_stride(const Split& s) { return s.stride > 0 ? s.stride : s.n_second; }

SplitArgs split_args(const Split& s, const char* what) {
  check_split(s, what);
  detail::require(row_stride(s) >= s.n_second && s.offset >= 0, std::string(what) + ": bad column block of a parameter");
  return {static_cast<std::uint32_t>(split_size(s)), static_cast<std::uint32_t>(s.n_second),
          static_cast<std::uint32_t>(n_vec(s)), static_cast<std::uint32_t>(n_mat(s)), s.vec_on_first, row_stride(s),
          s.offset};
}

// The largest flat index of a split plus one: the width its block needs in H.
index_t split_extent(const Split& s) { return (s.n_first - 1) * row_stride(s) + s.n_second + s.offset; }

template <class T>
void kron_accumulate(index_t tokens, Split si, const T* u, Split sj, const T* w, const T* Gamma, T alpha, T* H,
                     index_t ldH, bool upper_only, std::uintptr_t stream) {
  const SplitArgs ai = split_args(si, "kron_accumulate"), aj = split_args(sj, "kron_accumulate");
  detail::require(tokens >= 0, "kron_accumulate: tokens must be >= 0");
  detail::require(ldH >= split_extent(sj), "kron_accumulate: ldH is smaller than the block width");
  if (tokens == 0) return;
  const index_t ni = ai.size, nj = aj.size;
  const dim3 grid(detail::grid_x(ni), col_tiles(nj, ni));
  kron_accumulate_kernel<T><<<grid, kMaxThreads, 0, detail::as_stream(stream)>>>(tokens, ai, u, aj, w, Gamma, alpha,
                                                                                 H, ldH, upper_only);
  detail::check_launch("kron_accumulate");
}

template <class T>
void kron_accumulate_diagonal(index_t tokens, Split si, const T* u, Split sj, const T* w, const T* D, T alpha, T* H,
                              index_t ldH, std::uintptr_t stream) {
  const SplitArgs ai = split_args(si, "kron_accumulate_diagonal"), aj = split_args(sj, "kron_accumulate_diagonal");
  detail::require(ai.n_mat == aj.n_mat, "kron_accumulate_diagonal: the matrix indices must have one size");
  detail::require(tokens >= 0, "kron_accumulate_diagonal: tokens must be >= 0");
  detail::require(ldH >= split_extent(sj), "kron_accumulate_diagonal: ldH is smaller than the block width");
  if (tokens == 0) return;
  const index_t rows = static_cast<index_t>(ai.n_vec) * ai.n_mat;
  const dim3 grid(detail::grid_x(rows), col_tiles(aj.n_vec, rows));
  kron_accumulate_diagonal_kernel<T><<<grid, kMaxThreads, 0, detail::as_stream(stream)>>>(tokens, ai, u, aj, w, D,
                                                                                          alpha, H, ldH);
  detail::check_launch("kron_accumulate_diagonal");
}

template <class T>
void gram_upper_accumulate(index_t rows, index_t n, const T* J, const T* K, T* H, index_t ld, std::uintptr_t stream) {
  detail::require(rows >= 0 && n >= 0 && ld >= n, "gram_upper_accumulate: need rows, n >= 0 and ld >= n");
  if (rows == 0 || n == 0) return;
  const dim3 grid(detail::grid_x(n), col_tiles(n, n));
  gram_upper_kernel<T><<<grid, kMaxThreads, 0, detail::as_stream(stream)>>>(rows, n, J, K, H, ld);
  detail::check_launch("gram_upper_accumulate");
}

template <class T>
void flag_nonfinite(const T* H, index_t n, index_t ld, unsigned* flag, std::uintptr_t stream) {
  detail::require(n >= 0 && ld >= n, "flag_nonfinite: need 0 <= n <= ld");
  if (n == 0) return;
  flag_nonfinite_kernel<T><<<detail::elementwise_blocks(n * n), kMaxThreads, 0, detail::as_stream(stream)>>>(H, n, ld,
                                                                                                            flag);
  detail::check_launch("flag_nonfinite");
}

template <class T>
void mirror_upper(T* H, index_t n, index_t ld, std::uintptr_t stream) {
  detail::require(n >= 0 && ld >= n, "mirror_upper: need 0 <= n <= ld");
  if (n < 2) return;
  const index_t tiles = (n + kTile - 1) / kTile;
  detail::require(tiles <= static_cast<index_t>(detail::kMaxGridY), "mirror_upper: matrix too large");
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(tiles)), block(kTile, 8);
  mirror_kernel<T><<<grid, block, 0, detail::as_stream(stream)>>>(H, n, ld);
  detail::check_launch("mirror_upper");
}

#define BLOCKHESS_INSTANTIATE(T)                                                                                   \
  template void commute<T>(const T*, index_t, index_t, index_t, T*, std::uintptr_t);                               \
  template void commutation_dense<T>(index_t, index_t, T*, std::uintptr_t);                                        \
  template void kron_accumulate<T>(index_t, Split, const T*, Split, const T*, const T*, T, T*, index_t, bool,      \
                                   std::uintptr_t);                                                                \
  template void kron_accumulate_diagonal<T>(index_t, Split, const T*, Split, const T*, const T*, T, T*, index_t,   \
                                            std::uintptr_t);                                                       \
  template void gram_upper_accumulate<T>(index_t, index_t, const T*, const T*, T*, index_t, std::uintptr_t);       \
  template void flag_nonfinite<T>(const T*, index_t, index_t, unsigned*, std::uintptr_t);                          \
  template void mirror_upper<T>(T*, index_t, index_t, std::uintptr_t);
BLOCKHESS_INSTANTIATE(float)
BLOCKHESS_INSTANTIATE(double)
#undef BLOCKHESS_INSTANTIATE

}  // namespace blockhess::cuda::assembly
