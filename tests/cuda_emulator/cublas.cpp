// A stand-in for the cuBLAS entry points the GPU backend calls (cuda/src/cublas.cuh), for the CPU
// kernel emulator only (tests/kernel_emulation.py builds it in place of cuda/src/cublas.cu).
//
// It checks every argument as cuBLAS documents it (a handle it made, operations N or T,
// non-negative sizes, leading dimensions at least the rows of what they stride over: status 7,
// CUBLAS_STATUS_INVALID_VALUE, otherwise) and computes column-major
// C = alpha op(A) op(B) + beta C in plain loops, C never read where beta is 0 (as cuBLAS), so a
// wrong operand order, operation, leading dimension or batch stride in the backend gives a wrong
// result or a failed status. It remembers the stream set on each handle (last_stream()).
#include <cuda_runtime.h>  // the emulator's (cuda_runtime.h here)

#include <algorithm>
#include <cstdint>

#include "../../cuda/src/cublas.cuh"

namespace {

constexpr int kInvalidValue = 7, kNotInitialized = 1;
constexpr std::uint64_t kMagic = 0xb10c4e55;

struct Handle {
  std::uint64_t magic = kMagic;
  void* stream = nullptr;
};

thread_local std::uintptr_t g_last_stream = ~std::uintptr_t(0);

int create(void** handle) {
  *handle = new Handle;
  return 0;
}
int destroy(void* handle) {
  if (!handle || static_cast<Handle*>(handle)->magic != kMagic) return kNotInitialized;
  static_cast<Handle*>(handle)->magic = 0;
  delete static_cast<Handle*>(handle);
  return 0;
}
int set_stream(void* handle, void* stream) {
  if (!handle || static_cast<Handle*>(handle)->magic != kMagic) return kNotInitialized;
  static_cast<Handle*>(handle)->stream = stream;
  return 0;
}

template <class T>
int gemm_strided_batched(void* handle, int op_a, int op_b, int m, int n, int k, const T* alpha, const T* A, int lda,
                         long long stride_a, const T* B, int ldb, long long stride_b, const T* beta, T* C, int ldc,
                         long long stride_c, int count) {
  if (!handle || static_cast<Handle*>(handle)->magic != kMagic) return kNotInitialized;
  if ((op_a != 0 && op_a != 1) || (op_b != 0 && op_b != 1) || m < 0 || n < 0 || k < 0 || count < 0)
    return kInvalidValue;
  if (lda < std::max(1, op_a == 0 ? m : k) || ldb < std::max(1, op_b == 0 ? k : n) || ldc < std::max(1, m))
    return kInvalidValue;
  g_last_stream = reinterpret_cast<std::uintptr_t>(static_cast<Handle*>(handle)->stream);
  const blockhess_emu::DeviceWork work;  // device memory open while the products run
  for (int b = 0; b < count; ++b) {
    const T* a = A + b * stride_a;
    const T* bb = B + b * stride_b;
    T* c = C + b * stride_c;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        T sum = 0;
        for (int p = 0; p < k; ++p) {
          const T x = op_a == 0 ? a[i + p * static_cast<long long>(lda)] : a[p + i * static_cast<long long>(lda)];
          const T y = op_b == 0 ? bb[p + j * static_cast<long long>(ldb)] : bb[j + p * static_cast<long long>(ldb)];
          sum += x * y;
        }
        T& out = c[i + j * static_cast<long long>(ldc)];
        out = *beta == T(0) ? *alpha * sum : *alpha * sum + *beta * out;
      }
  }
  return 0;
}

template <class T>
int gemm(void* handle, int op_a, int op_b, int m, int n, int k, const T* alpha, const T* A, int lda, const T* B,
         int ldb, const T* beta, T* C, int ldc) {
  return gemm_strided_batched<T>(handle, op_a, op_b, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

}  // namespace

namespace blockhess::cuda::detail {

const Cublas& cublas() {
  static const Cublas stand_in = [] {
    Cublas c;
    c.create = create;
    c.destroy = destroy;
    c.set_stream = set_stream;
    c.sgemm = gemm<float>;
    c.dgemm = gemm<double>;
    c.sgemm_strided_batched = gemm_strided_batched<float>;
    c.dgemm_strided_batched = gemm_strided_batched<double>;
    return c;
  }();
  return stand_in;
}

}  // namespace blockhess::cuda::detail

// The stream the last product on this thread was queued on (all ones before any).
extern "C" __attribute__((visibility("default"))) std::uintptr_t cublas_standin_last_stream() { return g_last_stream; }
