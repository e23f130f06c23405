// The definitions behind kron_sum.hpp (the assembly primitive and its contract are described there).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <functional>
#include <stdexcept>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/kron_sum.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::kron {

// H (row stride ldH, already offset to the block's first entry) += the sum above.
// u: (tokens, si.n_vec()), w: (tokens, sj.n_vec()), both row-major.
// gamma(t, out) writes Gamma_t, (si.n_mat(), sj.n_mat()) row-major, for token t.
// upper_only: the block is a diagonal block of a symmetric matrix (same factors on both sides);
// only vector pairs o_j >= o_i are formed, which covers its upper triangle when vec_on_first.
// overwrite: H's old contents are ignored (saves a zero-fill pass over a memory-bound output).
// threads: whether it may use the thread pool (false: the caller is running many of these at once).
// Either way every entry comes out of the same GEMM, bit for bit.
template <class T>
void accumulate(index_t tokens, const Split& si, const T* u, const Split& sj, const T* w,
                const std::function<void(index_t, T*)>& gamma, T scale, T* H, index_t ldH, bool upper_only,
                bool overwrite, bool threads) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const index_t noi = si.n_vec(), nri = si.n_mat(), noj = sj.n_vec(), nrj = sj.n_mat();
  const index_t gsize = nri * nrj;
  if (tokens <= 0 || gsize == 0) return;
  upper_only = upper_only && si.vec_on_first && sj.vec_on_first && si.whole() && sj.whole();
  const index_t chunk = detail::chunk_tokens(tokens, gsize);
  RawBuffer<T> gammas(static_cast<size_t>(chunk * gsize));  // gamma() writes every Gamma_t before the GEMM reads it

  // Work is split by o_i: the rows of H that belong to one o_i are written by one task. Each task
  // takes a few consecutive o_i and forms all their (o_i, o_j) pairs with one GEMM, which packs the
  // large Gamma operand once per task. The split depends on the sizes only, never on the thread
  // count, so every entry of H comes out of the same GEMM shape, bit for bit, however many threads
  // run and whichever thread runs a task.
  const index_t oi_per_task = std::max<index_t>(
      1, std::min<index_t>((noi + detail::kTasks - 1) / detail::kTasks, (index_t(1) << 22) / (gsize * noj)));
  const index_t tasks = (noi + oi_per_task - 1) / oi_per_task;
  const int slots = parallel::num_threads();
  struct Scratch {
    RawBuffer<T> weights, R;  // grow only: no allocation per task; written whole before read
  };
  std::vector<Scratch> scratch;

  for (index_t t0 = 0; t0 < tokens; t0 += chunk) {
    const index_t nt = std::min(chunk, tokens - t0);
    const bool assign = overwrite && t0 == 0;
    const bool parallel = threads && noi * noj * nt * gsize > (1 << 18);  // else everything runs on the caller
    if (scratch.empty()) scratch.resize(parallel ? static_cast<size_t>(slots) : 1);
    const int n_slots = static_cast<int>(scratch.size());
    const Eigen::Map<const Mat> G(gammas.data(), nt, gsize);

    // One token at a time: a Gamma is small work, and the caller then never waits long for the
    // last one another thread is computing.
    blockhess::detail::parallel_for_slots(nt, parallel, 1, n_slots,
                                          [&](index_t t) { gamma(t0 + t, gammas.data() + t * gsize); });

    blockhess::detail::parallel_for_slots(tasks, parallel, 1, n_slots, [&](index_t task, int slot) {
      Scratch& sc = scratch[static_cast<size_t>(slot)];
      const index_t oi_begin = task * oi_per_task, oi_end = std::min(noi, oi_begin + oi_per_task);
      index_t m = 0;
      for (index_t oi = oi_begin; oi < oi_end; ++oi) m += noj - (upper_only ? oi : 0);
      if (static_cast<index_t>(sc.weights.size()) < m * nt) sc.weights.resize(static_cast<size_t>(m * nt));
      if (static_cast<index_t>(sc.R.size()) < m * gsize) sc.R.resize(static_cast<size_t>(m * gsize));
      Eigen::Map<Mat> weights(sc.weights.data(), m, nt), R(sc.R.data(), m, gsize);
      for (index_t oi = oi_begin, k = 0; oi < oi_end; ++oi)
        for (index_t oj = upper_only ? oi : 0; oj < noj; ++oj, ++k)
          for (index_t t = 0; t < nt; ++t) weights(k, t) = scale * u[(t0 + t) * noi + oi] * w[(t0 + t) * noj + oj];
      R.noalias() = weights * G;  // serial: the parallelism is over tasks
      for (index_t oi = oi_begin, k = 0; oi < oi_end; ++oi)
        for (index_t oj = upper_only ? oi : 0; oj < noj; ++oj, ++k)
          for (index_t ri = 0; ri < nri; ++ri) {
            T* row = H + si.flat(oi, ri) * ldH;
            const T* r = R.data() + k * gsize + ri * nrj;
            if (sj.vec_on_first) {
              T* dst = row + sj.flat(oj, 0);  // contiguous run over r_j
              if (assign) std::copy_n(r, nrj, dst);
              else for (index_t rj = 0; rj < nrj; ++rj) dst[rj] += r[rj];
            } else if (assign) {
              for (index_t rj = 0; rj < nrj; ++rj) row[sj.flat(oj, rj)] = r[rj];
            } else {
              for (index_t rj = 0; rj < nrj; ++rj) row[sj.flat(oj, rj)] += r[rj];
            }
          }
    });
  }
}

// The same sum when Gamma_t is diagonal, diag(D_t) (D: (tokens, r), or null for the identity),
// which happens where one parameter's matrix index meets the other's directly: a bilinear term
// <g, dX dW> whose dX enters through a pointwise map (W_1 with W_2 through relu) or through a
// product of two varying operands (W_Q with W_K in Q K^T). Both parameters then share the matrix
// index r, and
//     H[flat_i(o_i, r), flat_j(o_j, r)] += scale * sum_t u_t[o_i] * w_t[o_j] * D_t[r],
// one (n_vec_i x n_vec_j) GEMM over tokens per r (one in all for the identity) instead of a
// Gamma of r^2 entries per token.
// threads as for accumulate.
template <class T>
void accumulate_diagonal(index_t tokens, const Split& si, const T* u, const Split& sj, const T* w, const T* D,
                         T scale, T* H, index_t ldH, bool threads) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat>;
  const index_t noi = si.n_vec(), noj = sj.n_vec(), r = si.n_mat();
  if (sj.n_mat() != r) throw std::logic_error("kron::accumulate_diagonal: the matrix indices must have one size");
  if (tokens <= 0 || r == 0) return;
  const CMap U(u, tokens, noi), W(w, tokens, noj);
  auto scatter = [&](const Mat& M, index_t k) {
    for (index_t oi = 0; oi < noi; ++oi) {
      T* row = H + si.flat(oi, k) * ldH;
      for (index_t oj = 0; oj < noj; ++oj) row[sj.flat(oj, k)] += scale * M(oi, oj);
    }
  };
  auto for_each_r = [&](index_t work, auto&& body) {
    if (threads) blockhess::detail::parallel_for(r, work, body);
    else for (index_t k = 0; k < r; ++k) body(k);
  };
  if (D == nullptr) {
    const Mat M = U.transpose() * W;
    for_each_r(noi * noj, [&](index_t k) { scatter(M, k); });
    return;
  }
  for_each_r(tokens * noi * noj, [&](index_t k) {
    Mat Uk = U;
    for (index_t t = 0; t < tokens; ++t) Uk.row(t) *= D[t * r + k];
    const Mat M = Uk.transpose() * W;
    scatter(M, k);
  });
}

// Copies the upper triangle of the n x n matrix H onto its lower triangle, so that H is symmetric
// bit for bit (every pair is computed once, then mirrored). Returns whether every entry of H is
// finite, checked on the values as they are mirrored (the upper triangle and the diagonal), so the
// check costs no extra pass over the matrix.
template <class T>
bool mirror_upper(T* H, index_t n) {
  constexpr index_t tile = 32;  // measured best on a 2816 x 2816 matrix (AVX-512 machine)
  const index_t tiles = (n + tile - 1) / tile;
  std::atomic<bool> all_finite{true};
  // One item per row of tiles (work grows with the row: the threads claim them dynamically).
  blockhess::detail::parallel_for_slots(tiles, n > 256, 1, parallel::num_threads(), [&](index_t ti) {
    const index_t i0 = ti * tile, i1 = std::min(n, i0 + tile);
    bool ok = true;
    for (index_t j0 = 0; j0 <= i0; j0 += tile)
      for (index_t i = i0; i < i1; ++i)
        for (index_t j = j0; j < std::min(i, j0 + tile); ++j) {
          const T v = H[j * n + i];
          ok &= is_finite(v);
          H[i * n + j] = v;
        }
    for (index_t i = i0; i < i1; ++i) ok &= is_finite(H[i * n + i]);
    if (!ok) all_finite.store(false, std::memory_order_relaxed);
  });
  return all_finite.load(std::memory_order_relaxed);
}

}  // namespace blockhess::kron
