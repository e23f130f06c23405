// The GPU backend (blockhess/backend.hpp): products by cuBLAS, row operations by a kernel each,
// memory in the order of one stream (runtime.hpp). Plain C++: the CUDA and cuBLAS types stay inside cuda/src.
//
// cuBLAS is the one CuPy and PyTorch load (libcublas.so.13, found when the backend is first made):
// the build needs no cuBLAS, and a machine without a GPU never loads it.
#pragma once

#include <cstdint>

#include "blockhess/backend.hpp"

namespace blockhess::cuda {

template <class T>
class CudaBackend final : public Backend<T> {
 public:
  // Work queued on `stream` (a cudaStream_t as an integer; 0: the legacy default stream) with the
  // cuBLAS handle `handle` (CuPy's, say), or one of its own where `handle` is 0.
  explicit CudaBackend(std::uintptr_t stream, std::uintptr_t handle = 0);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void gemm(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha, bool accumulate) const override;
  void gemm_batched(index_t count, MatrixView<T> C, index_t c_step, MatrixView<const T> A, index_t a_step,
                    MatrixView<const T> B, index_t b_step, T alpha, bool accumulate) const override;
#define BLOCKHESS_DECLARE_GPU_RUN(Op) void run(const engine::rows::Op<T>& op, index_t count) const override;
  BLOCKHESS_ROW_OPS(BLOCKHESS_DECLARE_GPU_RUN)
#undef BLOCKHESS_DECLARE_GPU_RUN
  bool all_finite(const T* values, index_t n) const override;
  T* allocate(index_t n) const override;
  void release(T* p, index_t n) const noexcept override;
  void upload(void* data, const void* host, std::size_t bytes) const override;
  void download(void* host, const void* data, std::size_t bytes) const override;
  std::uintptr_t stream() const override { return stream_; }
  bool host_addressable() const override { return false; }

 private:
  std::uintptr_t stream_;
  void* handle_;  // cublasHandle_t
  bool owns_handle_;
};

extern template class CudaBackend<float>;
extern template class CudaBackend<double>;

}  // namespace blockhess::cuda
