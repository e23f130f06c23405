// The engine's assembly target on the GPU: engine::assemble() (engine/assemble.hpp) writes the
// Hessian into device memory through this, as it writes host memory through engine::HostHessian.
// The engine's per-token work (forward, reverse, factors and each Gamma_t) stays on the host; the
// (P, P) sums over tokens, the mirror and the finiteness check run on the GPU (assembly.hpp), in
// the order of one stream. Host code: it calls the launchers and includes no CUDA header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/cuda/assembly.hpp"
#include "blockhess/cuda/runtime.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::cuda {

template <class T>
struct DeviceHessian {
  T* H = nullptr;  // device memory, (P, P) row-major
  index_t P = 0;
  std::uintptr_t stream = 0;
  static constexpr bool concurrent_blocks = false;  // one stream: the blocks go in order

  static Split split(const kron::Split& s) { return Split{s.n_first, s.n_second, s.vec_on_first, s.stride, s.offset}; }

  // The kernels accumulate, so every block starts from zero (no "overwrite" steps).
  void begin() { fill_zero(H, static_cast<std::size_t>(P * P) * sizeof(T), stream); }

  // Gamma_t is formed on the host a chunk of tokens at a time (kron::accumulate's chunks), then
  // the chunk's sum is added on the GPU.
  template <class GammaFn>
  void kron(index_t row, index_t col, index_t tokens, const kron::Split& si, const T* u, const kron::Split& sj,
            const T* w, GammaFn&& gamma, bool upper_only, bool /*overwrite*/, bool threads) {
    const index_t noi = si.n_vec(), noj = sj.n_vec(), gsize = si.n_mat() * sj.n_mat();
    if (tokens <= 0 || gsize == 0) return;
    const index_t chunk = kron::detail::chunk_tokens(tokens, gsize);
    DeviceArray<T> du(static_cast<std::size_t>(tokens * noi), stream), dw(static_cast<std::size_t>(tokens * noj), stream),
        dg(static_cast<std::size_t>(chunk * gsize), stream);
    du.upload(u, static_cast<std::size_t>(tokens * noi));
    dw.upload(w, static_cast<std::size_t>(tokens * noj));
    RawBuffer<T> gammas(static_cast<std::size_t>(chunk * gsize));
    for (index_t t0 = 0; t0 < tokens; t0 += chunk) {
      const index_t nt = std::min(chunk, tokens - t0);
      auto one = [&](index_t t) { gamma(t0 + t, gammas.data() + t * gsize); };
      if (threads) blockhess::detail::parallel_for(nt, gsize * std::max(si.n_mat(), sj.n_mat()), one);
      else for (index_t t = 0; t < nt; ++t) one(t);
      dg.upload(gammas.data(), static_cast<std::size_t>(nt * gsize));  // gammas is free again on return
      assembly::kron_accumulate<T>(nt, split(si), du.data() + t0 * noi, split(sj), dw.data() + t0 * noj, dg.data(),
                                   T(1), H + row * P + col, P, upper_only, stream);
    }
  }

  void kron_diagonal(index_t row, index_t col, index_t tokens, const kron::Split& si, const T* u,
                     const kron::Split& sj, const T* w, const T* D, bool /*threads*/) {
    const index_t noi = si.n_vec(), noj = sj.n_vec(), r = si.n_mat();
    if (tokens <= 0 || r == 0) return;
    DeviceArray<T> du(static_cast<std::size_t>(tokens * noi), stream), dw(static_cast<std::size_t>(tokens * noj), stream),
        dD(D ? static_cast<std::size_t>(tokens * r) : 0, stream);
    du.upload(u, static_cast<std::size_t>(tokens * noi));
    dw.upload(w, static_cast<std::size_t>(tokens * noj));
    if (D) dD.upload(D, static_cast<std::size_t>(tokens * r));
    assembly::kron_accumulate_diagonal<T>(tokens, split(si), du.data(), split(sj), dw.data(), D ? dD.data() : nullptr,
                                          T(1), H + row * P + col, P, stream);
  }

  void zero(index_t, index_t, const kron::Split&, const kron::Split&) {}  // begin() zeroed every block

  // The token-summed Jacobians are built on the host (engine::detail::pooled_rows), their
  // products added on the GPU.
  void pooled(const engine::Graph<T>& g, const engine::PooledSite<T>& site, const std::vector<int>& pieces,
              const std::vector<index_t>& offset) {
    engine::detail::pooled_rows(g, site, pieces, offset, P, [&](const Mat<T>& J, const Mat<T>& K, index_t rows) {
      DeviceArray<T> dJ(static_cast<std::size_t>(rows * P), stream), dK(static_cast<std::size_t>(rows * P), stream);
      dJ.upload(J.data(), static_cast<std::size_t>(rows * P));  // row-major: the first rows are contiguous
      dK.upload(K.data(), static_cast<std::size_t>(rows * P));
      assembly::gram_upper_accumulate<T>(rows, P, dJ.data(), dK.data(), H, P, stream);
    });
  }

  bool mirror() {
    assembly::mirror_upper<T>(H, P, P, stream);
    DeviceArray<unsigned> flag(1, stream);
    fill_zero(flag.data(), sizeof(unsigned), stream);
    assembly::flag_nonfinite<T>(H, P, P, flag.data(), stream);
    unsigned bad = 0;
    copy_to_host(&bad, flag.data(), sizeof(unsigned), stream);
    return bad == 0;
  }
};

}  // namespace blockhess::cuda
