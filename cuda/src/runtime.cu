#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "blockhess/cuda/runtime.hpp"

namespace blockhess::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

void synchronize(std::uintptr_t stream) {
  const cudaError_t err = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err));
}

}  // namespace blockhess::cuda
