// Plain C++ view of the CUDA runtime for the bindings: no CUDA headers leak out of cuda/.
#pragma once

#include <cstdint>

namespace blockhess::cuda {

// Number of visible CUDA devices; 0 when there is no GPU or no driver (never throws for that).
int device_count();

// Blocks until all work queued on `stream` is done; throws std::runtime_error on a CUDA error.
void synchronize(std::uintptr_t stream);

}  // namespace blockhess::cuda
