// Portability macros shared by the C++ core and the CUDA kernels.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#define BLOCKHESS_HD __host__ __device__
#else
#define BLOCKHESS_HD
#endif

namespace blockhess {
using index_t = std::ptrdiff_t;
}  // namespace blockhess
