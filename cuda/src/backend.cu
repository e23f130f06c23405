// The GPU backend (backend.hpp). Products through cuBLAS, which is column-major: a row-major C is
// the column-major C^T, and C^T = B^T A^T, so every product is cuBLAS's with the operands swapped,
// a row-major operand read as it lies (N) and a column-major one transposed (T). Row operations
// (engine/row_ops.hpp) by one kernel each, a thread per item.
#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "blockhess/cuda/backend.hpp"
#include "blockhess/cuda/runtime.hpp"
#include "blockhess/engine/rows.hpp"
#include "common.cuh"
#include "cublas.cuh"

namespace blockhess::cuda {
namespace {

int as_int(index_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw std::invalid_argument(std::string("blockhess CUDA: ") + what + " " + std::to_string(v) +
                                " is out of cuBLAS's range (0 to 2^31 - 1)");
  return static_cast<int>(v);
}

// An operand as cuBLAS reads it: its operation and leading dimension.
struct Operand {
  int op, ld;
};
template <class T>
Operand operand(const MatrixView<T>& v, const char* what) {
  // The stride spans the rows (row-major) or columns; it means nothing where there is only one, and
  // cuBLAS wants it at least the length of what it strides over.
  const index_t inner = v.row_major ? v.cols : v.rows, outer = v.row_major ? v.rows : v.cols;
  const index_t ld = outer <= 1 ? std::max<index_t>({v.stride, inner, 1}) : v.stride;
  return {v.row_major ? detail::kOpN : detail::kOpT, as_int(ld, what)};
}

// Items [0, count) of a row operation, a thread each, grid-stride beyond the grid's limit; an op with
// scratch gets its own piece of `per_item` entries an item.
template <class Op, class T>
__global__ void run_items(Op op, index_t count, T* scratch, index_t per_item) {
  const index_t step = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step) {
    if constexpr (engine::rows::kScratch<Op>) op(i, i + 1, scratch + i * per_item);
    else op(i, i + 1);
  }
}

// *flag |= 1 where an entry of values is Inf or NaN.
template <class T>
__global__ void flag_nonfinite_entries(const T* values, index_t n, unsigned* flag) {
  const index_t step = static_cast<index_t>(blockDim.x) * gridDim.x;
  bool bad = false;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    bad |= !(values[i] - values[i] == T(0));  // Inf - Inf and NaN - NaN are NaN
  if (bad) atomicOr(flag, 1u);
}

void check_status(int status, const char* what) {
  if (status != 0)
    throw std::runtime_error(std::string("blockhess CUDA: cuBLAS ") + what + " failed with status " +
                             std::to_string(status));
}

template <class T>
void check_shapes(const MatrixView<T>& C, const MatrixView<const T>& A, const MatrixView<const T>& B) {
  if (!C.row_major) throw std::invalid_argument("blockhess CUDA: a product's result must be row-major");
  if (A.rows != C.rows || B.cols != C.cols || A.cols != B.rows)
    throw std::invalid_argument("blockhess CUDA: a product's shapes do not match");
}

}  // namespace

template <class T>
CudaBackend<T>::CudaBackend(std::uintptr_t stream, std::uintptr_t handle)
    : stream_(stream), handle_(reinterpret_cast<void*>(handle)), owns_handle_(handle == 0) {
  if (owns_handle_) check_status(detail::cublas().create(&handle_), "create");
}

template <class T>
CudaBackend<T>::~CudaBackend() {
  if (owns_handle_ && handle_) detail::cublas().destroy(handle_);
}

template <class T>
void CudaBackend<T>::gemm(MatrixView<T> C, MatrixView<const T> A, MatrixView<const T> B, T alpha,
                          bool accumulate) const {
  gemm_batched(1, C, 0, A, 0, B, 0, alpha, accumulate);
}

template <class T>
void CudaBackend<T>::gemm_batched(index_t count, MatrixView<T> C, index_t c_step, MatrixView<const T> A,
                                  index_t a_step, MatrixView<const T> B, index_t b_step, T alpha,
                                  bool accumulate) const {
  check_shapes(C, A, B);
  const index_t m = C.rows, n = C.cols, k = A.cols;
  if (count <= 0 || m == 0 || n == 0) return;
  if (k == 0) {  // a product of depth 0: zeros assigned, nothing added
    if (!accumulate)
      for (index_t c = 0; c < count; ++c)
        detail::check(cudaMemset2DAsync(C.data + c * c_step, static_cast<size_t>(C.stride) * sizeof(T), 0,
                                        static_cast<size_t>(n) * sizeof(T), static_cast<size_t>(m),
                                        detail::as_stream(stream_)),
                      "gemm (depth 0)");
    return;
  }
  const detail::Cublas& cb = detail::cublas();
  const Operand a = operand(A, "a product's leading dimension"), b = operand(B, "a product's leading dimension");
  const Operand c{detail::kOpN, as_int(std::max<index_t>(C.stride, n), "a product's leading dimension")};
  const int mi = as_int(m, "a product's rows"), ni = as_int(n, "a product's columns"), ki = as_int(k, "a product's depth");
  const T beta = accumulate ? T(1) : T(0);
  check_status(cb.set_stream(handle_, reinterpret_cast<void*>(stream_)), "set_stream");
  if (count == 1)
    check_status(cb.gemm<T>()(handle_, b.op, a.op, ni, mi, ki, &alpha, B.data, b.ld, A.data, a.ld, &beta, C.data, c.ld),
                 "gemm");
  else
    check_status(cb.gemm_strided_batched<T>()(handle_, b.op, a.op, ni, mi, ki, &alpha, B.data, b.ld, b_step, A.data,
                                              a.ld, a_step, &beta, C.data, c.ld, c_step,
                                              as_int(count, "a batch's count")),
                 "gemm_strided_batched");
}

#define BLOCKHESS_RUN_ON_GPU(Op)                                                                             \
  template <class T>                                                                                          \
  void CudaBackend<T>::run(const engine::rows::Op<T>& op, index_t count) const {                            \
    if (count <= 0) return;                                                                                   \
    using RowOp = engine::rows::Op<T>;                                                                        \
    index_t per_item = 0;                                                                                     \
    if constexpr (engine::rows::kScratch<RowOp>) per_item = op.scratch_size();                                \
    DeviceArray<T> scratch(static_cast<std::size_t>(count * per_item), stream_);                              \
    run_items<RowOp, T><<<detail::elementwise_blocks(count), detail::kMaxThreads, 0, detail::as_stream(stream_)>>>( \
        op, count, scratch.data(), per_item);                                                                 \
    detail::check_launch("row operation " #Op);                                                               \
  }
BLOCKHESS_ROW_OPS(BLOCKHESS_RUN_ON_GPU)
#undef BLOCKHESS_RUN_ON_GPU

template <class T>
bool CudaBackend<T>::all_finite(const T* values, index_t n) const {
  if (n <= 0) return true;
  DeviceArray<unsigned> flag(1, stream_);
  fill_zero(flag.data(), sizeof(unsigned), stream_);
  flag_nonfinite_entries<T><<<detail::elementwise_blocks(n), detail::kMaxThreads, 0, detail::as_stream(stream_)>>>(
      values, n, flag.data());
  detail::check_launch("all_finite");
  unsigned bad = 0;
  copy_to_host(&bad, flag.data(), sizeof(unsigned), stream_);  // waits for the stream
  return bad == 0;
}

template <class T>
T* CudaBackend<T>::allocate(index_t n) const {
  return static_cast<T*>(cuda::allocate(static_cast<std::size_t>(n) * sizeof(T), stream_));
}

template <class T>
void CudaBackend<T>::release(T* p, index_t) const noexcept {
  if (p) cuda::release(p, stream_);
}

template <class T>
void CudaBackend<T>::upload(void* data, const void* host, std::size_t bytes) const {
  if (bytes) copy_to_device(data, host, bytes, stream_);
}

template <class T>
void CudaBackend<T>::download(void* host, const void* data, std::size_t bytes) const {
  if (bytes) copy_to_host(host, data, bytes, stream_);
}

template class CudaBackend<float>;
template class CudaBackend<double>;

}  // namespace blockhess::cuda
