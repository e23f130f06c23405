// Finds cuBLAS at run time (cublas.cuh): the library CuPy or PyTorch already loaded, else the one
// the dynamic loader finds.
#include <dlfcn.h>

#include <stdexcept>
#include <string>

#include "cublas.cuh"

namespace blockhess::cuda::detail {
namespace {

constexpr const char* kLibrary = "libcublas.so.13";  // the CUDA 13 cuBLAS, as the kernels' runtime

void* open_library() {
  if (void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_NOLOAD)) return lib;  // already loaded: CuPy's, PyTorch's
  if (void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL)) return lib;
  throw std::runtime_error(std::string("blockhess CUDA: cuBLAS (") + kLibrary +
                           ") was not found; install cupy-cuda13x (or nvidia-cublas for CUDA 13), or import cupy "
                           "before blockhess's GPU functions run");
}

template <class Fn>
void resolve(void* lib, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!fn) throw std::runtime_error(std::string("blockhess CUDA: cuBLAS has no ") + name);
}

Cublas load() {
  void* lib = open_library();  // never closed: the entry points live as long as the process
  Cublas c;
  resolve(lib, "cublasCreate_v2", c.create);
  resolve(lib, "cublasDestroy_v2", c.destroy);
  resolve(lib, "cublasSetStream_v2", c.set_stream);
  resolve(lib, "cublasSgemm_v2", c.sgemm);
  resolve(lib, "cublasDgemm_v2", c.dgemm);
  resolve(lib, "cublasSgemmStridedBatched", c.sgemm_strided_batched);
  resolve(lib, "cublasDgemmStridedBatched", c.dgemm_strided_batched);
  return c;
}

}  // namespace

const Cublas& cublas() {
  static const Cublas entry_points = load();  // thread-safe once; a failed load is retried next call
  return entry_points;
}

}  // namespace blockhess::cuda::detail
