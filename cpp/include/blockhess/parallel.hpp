// Parallel loops of the core, on its own passive thread pool (thread_pool.hpp). No OpenMP.
#pragma once

#include <algorithm>
#include <type_traits>

#include "blockhess/config.hpp"
#include "blockhess/thread_pool.hpp"

namespace blockhess::detail {

// Below this much work (in multiply-adds) a parallel loop costs more than it saves: it runs on
// the calling thread alone.
constexpr index_t kParallelWorkThreshold = 1 << 15;
// Least work per chunk handed to a thread (amortises the atomic claim and the cache misses).
constexpr index_t kMinChunkWork = 1 << 13;
// Chunks per thread: spare chunks let the threads that are running take over the share of one that
// is descheduled (another process is using its core) instead of waiting for it.
constexpr index_t kChunksPerThread = 4;

// Items per chunk for n items of `work_per_item` on `threads` threads.
inline index_t chunk_size(index_t n, index_t work_per_item, index_t threads) {
  const index_t by_balance = (n + kChunksPerThread * threads - 1) / (kChunksPerThread * threads);
  const index_t by_work = (kMinChunkWork + work_per_item - 1) / std::max<index_t>(1, work_per_item);
  return std::max<index_t>(1, std::max(by_balance, by_work));
}

// Calls body(i) or body(i, slot) with the items of [b, e).
template <class Body>
void run_items(Body& body, index_t b, index_t e, int slot) {
  for (index_t i = b; i < e; ++i) {
    if constexpr (std::is_invocable_v<Body&, index_t, int>) body(i, slot);
    else body(i);
  }
}

// Runs body(i) for i in [0, n); in parallel when the total work is large enough. Every i must
// write its own outputs: which thread runs which i varies from call to call, the results do not.
// body may also take (i, slot), slot in [0, parallel::num_threads()) naming the thread for the
// duration of this call (per-thread scratch; see parallel_for_slots).
template <class Body>
void parallel_for(index_t n, index_t work_per_item, Body&& body) {
  if (n > 1 && n * work_per_item >= kParallelWorkThreshold) {
    const int threads = parallel::num_threads();
    parallel::for_chunks(n, chunk_size(n, work_per_item, threads), threads,
                         [&body](index_t b, index_t e, int slot) { run_items(body, b, e, slot); });
    return;
  }
  run_items(body, 0, n, 0);
}

// body(begin, end, slot) over ranges that cover [0, n): in chunks on the threads when the total work
// is large enough, else [0, n) at once on the caller (slot 0). slot < parallel::num_threads() names
// the thread for the call (per-thread scratch). Each item must write its own outputs.
template <class Body>
void parallel_ranges(index_t n, index_t work_per_item, Body&& body) {
  if (n > 1 && n * work_per_item >= kParallelWorkThreshold) {
    const int threads = parallel::num_threads();
    parallel::for_chunks(n, chunk_size(n, work_per_item, threads), threads,
                         [&body](index_t b, index_t e, int slot) { body(b, e, slot); });
    return;
  }
  if (n > 0) body(0, n, 0);
}

// As parallel_for, but the caller decides whether to go parallel and how many items form a chunk,
// and at most `slots` threads take part (slot < slots: size per-thread scratch with it).
template <class Body>
void parallel_for_slots(index_t n, bool parallel, index_t chunk, int slots, Body&& body) {
  if (parallel && n > 1) {
    parallel::for_chunks(n, chunk, slots, [&body](index_t b, index_t e, int slot) { run_items(body, b, e, slot); });
    return;
  }
  run_items(body, 0, n, 0);
}

}  // namespace blockhess::detail
