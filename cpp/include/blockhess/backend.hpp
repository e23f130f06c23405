// What the engine asks of the machine it runs on: its backend.
//
// The engine (engine/) is written once against this interface; a backend says how the work is
// done: on the host (cpu_backend.hpp: the core's Eigen products on its thread pool, the memory
// cache) or on a GPU (cuda/: cuBLAS on a stream, stream-ordered device memory, a kernel per row
// operation). Each operation here moves a whole matrix, a batch of them or every token's rows, so
// a virtual call costs nothing next to it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "blockhess/config.hpp"
#include "blockhess/engine/row_ops.hpp"

namespace blockhess {

// A dense matrix in the backend's memory: rows x cols, `stride` apart between rows (row_major) or
// columns.
template <class T>
struct MatrixView {
  T* data = nullptr;
  index_t rows = 0, cols = 0, stride = 0;
  bool row_major = true;
};

template <class T>
MatrixView<const T> read_only(MatrixView<T> v) {
  return MatrixView<const T>{v.data, v.rows, v.cols, v.stride, v.row_major};
}

template <class T>
class Backend {
 public:
  virtual ~Backend() = default;

  // C = alpha * A * B (assign) or C += alpha * A * B (accumulate); C row-major. A product of
  // depth 0 assigns zeros.
  virtual void gemm(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha, bool accumulate) const = 0;

  // `count` such products, the k-th on the views moved by k * step (in elements) each: the heads
  // of an attention, the samples of a batch. Each product is the one gemm() would make.
  virtual void gemm_batched(index_t count, MatrixView<T> C, index_t c_step, MatrixView<const T> A, index_t a_step,
                            MatrixView<const T> B, index_t b_step, T alpha, bool accumulate) const = 0;

  // Items [0, count) of a row operation (engine/row_ops.hpp), each written by its item only.
#define BLOCKHESS_DECLARE_RUN(Op) virtual void run(const engine::rows::Op<T>& op, index_t count) const = 0;
  BLOCKHESS_ROW_OPS(BLOCKHESS_DECLARE_RUN)
#undef BLOCKHESS_DECLARE_RUN

  // Whether all n values (in the backend's memory) are finite: the passes' checks, read on the host
  // (on a GPU this waits for the work queued before it).
  virtual bool all_finite(const T* values, index_t n) const = 0;

  // Storage for n values in the backend's memory, uninitialised, and its return.
  virtual T* allocate(index_t n) const = 0;
  virtual void release(T* p, index_t n) const noexcept = 0;

  // Copies of `bytes` bytes between the host's memory and the backend's: upload after the work
  // queued before it, download returning when the bytes are on the host.
  virtual void upload(void* data, const void* host, std::size_t bytes) const = 0;
  virtual void download(void* host, const void* data, std::size_t bytes) const = 0;

  // The stream the work is queued on, in call order (0: the host's, each call done on return).
  virtual std::uintptr_t stream() const = 0;

  // Whether the host reads and writes the backend's memory directly. What of the engine still runs
  // on the host (its curvature, docs/backends.md) refuses a backend whose memory it cannot address.
  virtual bool host_addressable() const = 0;
};

}  // namespace blockhess
