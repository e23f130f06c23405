// OpenMP helpers. The core never requires OpenMP: without it every loop runs serially.
#pragma once

#include "blockhess/config.hpp"

namespace blockhess::detail {

// Below this much work (in multiply-adds) a parallel region costs more than it saves.
constexpr index_t kParallelWorkThreshold = 1 << 15;

// Run body(i) for i in [0, n); in parallel when OpenMP is on and the total work is large enough.
template <class Body>
void parallel_for(index_t n, index_t work_per_item, Body&& body) {
#if defined(_OPENMP)
  if (n > 1 && n * work_per_item >= kParallelWorkThreshold) {
#pragma omp parallel for schedule(static)
    for (index_t i = 0; i < n; ++i) body(i);
    return;
  }
#else
  (void)work_per_item;  // only the OpenMP path uses it
#endif
  for (index_t i = 0; i < n; ++i) body(i);
}

}  // namespace blockhess::detail
