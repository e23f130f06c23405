// The host backend (backend.hpp): the core's one matrix product on its thread pool
// (parallel_product.hpp), a batch as its products in order, the row operations' items split over
// the same threads, memory from the core's cache (memory_cache.hpp). The engine's results on it are those it had before backends existed, bit
// for bit.
#pragma once

#include <cstring>

#include "blockhess/backend.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/engine/rows.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/memory_cache.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"

namespace blockhess {

template <class T>
class CpuBackend final : public Backend<T> {
 public:
  void gemm(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha, bool accumulate) const override {
    matrix_product<T>(C, A, B, alpha, accumulate);
  }

  // Products too small to split (a norm's Jacobians a token) over the threads, one a thread;
  // larger ones (an attention's heads) one after another, each split over the threads itself
  // (matrix_product). Either way each product is the Eigen call gemm() makes: the same bits.
  void gemm_batched(index_t count, MatrixView<T> C, index_t c_step, MatrixView<const T> A, index_t a_step,
                    MatrixView<const T> B, index_t b_step, T alpha, bool accumulate) const override {
    const auto one = [&](index_t k) {
      MatrixView<T> c = C;
      MatrixView<const T> a = A, b = B;
      c.data += k * c_step, a.data += k * a_step, b.data += k * b_step;
      matrix_product<T>(c, a, b, alpha, accumulate);
    };
    const index_t work = C.rows * C.cols * A.cols;
    if (work < blockhess::detail::kParallelWorkThreshold) {
      blockhess::detail::parallel_for(count, work, one);
      return;
    }
    for (index_t k = 0; k < count; ++k) one(k);
  }

#define BLOCKHESS_RUN_ON_HOST(Op) \
  void run(const engine::rows::Op<T>& op, index_t count) const override { run_items(op, count); }
  BLOCKHESS_ROW_OPS(BLOCKHESS_RUN_ON_HOST)
#undef BLOCKHESS_RUN_ON_HOST

  bool all_finite(const T* values, index_t n) const override { return blockhess::all_finite(values, n); }

  T* allocate(index_t n) const override { return static_cast<T*>(memory::allocate(static_cast<std::size_t>(n) * sizeof(T))); }
  void release(T* p, index_t n) const noexcept override { memory::deallocate(p, static_cast<std::size_t>(n) * sizeof(T)); }
  void upload(void* data, const void* host, std::size_t bytes) const override {
    if (bytes) std::memcpy(data, host, bytes);
  }
  void download(void* host, const void* data, std::size_t bytes) const override {
    if (bytes) std::memcpy(host, data, bytes);
  }
  std::uintptr_t stream() const override { return 0; }
  bool host_addressable() const override { return true; }
 private:
  // An op with scratch (engine::rows::kScratch) gets one item's worth per thread, reused item after item.
  template <class Op>
  static void run_items(const Op& op, index_t count) {
    if constexpr (engine::rows::kScratch<Op>) {
      const index_t size = op.scratch_size();
      RawBuffer<T> scratch(static_cast<size_t>(size * parallel::num_threads()));
      blockhess::detail::parallel_ranges(count, op.cost(), [&](index_t b, index_t e, int slot) {
        op(b, e, scratch.data() + slot * size);
      });
    } else {
      blockhess::detail::parallel_ranges(count, op.cost(), [&op](index_t b, index_t e, int) { op(b, e); });
    }
  }
};

// The host backend: stateless, so one shared instance serves every graph and thread.
template <class T>
const Backend<T>& cpu_backend() {
  static const CpuBackend<T> backend;
  return backend;
}

}  // namespace blockhess
