// The cuBLAS entry points the GPU backend calls (backend.cu), declared here and resolved at run
// time from the cuBLAS that is already loaded (CuPy's, PyTorch's) or found by the loader
// (cublas.cu), so that the build needs no cuBLAS. The signatures are cuBLAS's v2 API: an opaque
// handle, operations as ints (0: N, 1: T), status 0 for success.
#pragma once

namespace blockhess::cuda::detail {

struct Cublas {
  template <class T>
  using Gemm = int (*)(void* handle, int op_a, int op_b, int m, int n, int k, const T* alpha, const T* A, int lda,
                       const T* B, int ldb, const T* beta, T* C, int ldc);
  template <class T>
  using GemmStridedBatched = int (*)(void* handle, int op_a, int op_b, int m, int n, int k, const T* alpha,
                                     const T* A, int lda, long long stride_a, const T* B, int ldb, long long stride_b,
                                     const T* beta, T* C, int ldc, long long stride_c, int count);

  int (*create)(void** handle) = nullptr;
  int (*destroy)(void* handle) = nullptr;
  int (*set_stream)(void* handle, void* stream) = nullptr;
  Gemm<float> sgemm = nullptr;
  Gemm<double> dgemm = nullptr;
  GemmStridedBatched<float> sgemm_strided_batched = nullptr;
  GemmStridedBatched<double> dgemm_strided_batched = nullptr;

  template <class T>
  Gemm<T> gemm() const;
  template <class T>
  GemmStridedBatched<T> gemm_strided_batched() const;
};

template <>
inline Cublas::Gemm<float> Cublas::gemm<float>() const { return sgemm; }
template <>
inline Cublas::Gemm<double> Cublas::gemm<double>() const { return dgemm; }
template <>
inline Cublas::GemmStridedBatched<float> Cublas::gemm_strided_batched<float>() const { return sgemm_strided_batched; }
template <>
inline Cublas::GemmStridedBatched<double> Cublas::gemm_strided_batched<double>() const {
  return dgemm_strided_batched;
}

constexpr int kOpN = 0, kOpT = 1;

// The entry points, resolved once per process (immutable afterwards); std::runtime_error naming
// what to install where no cuBLAS can be found.
const Cublas& cublas();

}  // namespace blockhess::cuda::detail
