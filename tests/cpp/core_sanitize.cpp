// Drives the header-only core through its public headers under AddressSanitizer, LeakSanitizer and
// UndefinedBehaviorSanitizer (tests/cpp/CMakeLists.txt, run by tests/test_sanitize.py).
//
// Every entry point of layernorm, softmax, commutation, attention, ffn, kron_sum (through the
// block Hessian) and block_loss runs at several shapes: L = 1, d = 1 where it is valid, d_k != d,
// odd sizes, batches B > 1, in double (and LayerNorm, softmax and the whole block in float too),
// with sizes large enough that the parallel loops run on the core's thread pool (1 and 3
// threads). The checks are cheap invariants: outputs finite, Hessians symmetric, dense layouts
// equal to their blocks, central finite differences of one Jacobian / gradient / Hessian-vector
// product (double), results independent of the thread count, and the documented exceptions for
// bad input. The sanitizers catch what the invariants cannot: out-of-bounds writes of the dense
// layouts, use-after-free of scratch buffers, leaks, signed overflow in index arithmetic.
// Returns 0 when every check passed.
//
// The checks are in core_sanitize_checks.hpp, instantiated for double and float in their own
// translation units, which build in parallel (under the sanitizers each takes one to two minutes
// of CPU: Eigen's products instantiated with ASan/UBSan instrumentation).
#include <cstdio>
#include <exception>
#include <random>

#include "blockhess/memory_cache.hpp"
#include "core_sanitize.hpp"

namespace {

void expect(bool ok, const char* what) {
  ++sanitize::g_checks;
  if (ok) return;
  ++sanitize::g_failures;
  std::fprintf(stderr, "FAIL memory cache: %s\n", what);
}

// The cache of large buffers: a freed block is kept and handed to the next request of its size
// class, the limit bounds what it keeps, release frees it all.
void check_memory_cache() {
  namespace mem = blockhess::memory;
  mem::release_cached();
  mem::set_cache_limit(std::size_t(4) << 20);
  const std::size_t n = 300000, cls = mem::size_class(n);
  expect(cls >= n && cls - n <= n / 8 && mem::size_class(cls) == cls, "size class within 1/8 and stable");
  void* a = mem::allocate(n);
  static_cast<char*>(a)[n - 1] = 1;  // the whole request is usable
  mem::deallocate(a, n);
  expect(mem::cached_bytes() == cls, "a freed block is kept");
  void* b = mem::allocate(cls - 1);
  expect(b == a && mem::cached_bytes() == 0, "the next request of its class reuses it");
  void* big = mem::allocate(std::size_t(5) << 20);
  mem::deallocate(big, std::size_t(5) << 20);
  expect(mem::cached_bytes() == 0, "a block beyond the limit is freed");
  mem::deallocate(b, cls - 1);
  void* other = mem::allocate(2 * n);  // a class the cache does not hold: it frees what it holds first
  expect(mem::cached_bytes() == 0, "a miss frees the held blocks");
  mem::deallocate(other, 2 * n);
  expect(mem::cached_bytes() == mem::size_class(2 * n), "and keeps the new block when it is freed");
  mem::set_cache_limit(0);
  expect(mem::cached_bytes() == 0, "lowering the limit frees what is over it");
  void* small = mem::allocate(100);
  mem::deallocate(small, 100);
  expect(mem::cached_bytes() == 0, "small blocks are never cached");
}

}  // namespace

int main() {
  std::mt19937_64 rng(20260101);
  check_memory_cache();
  // Every freed buffer goes straight back to the system (limit 0 after the check above), so
  // that AddressSanitizer sees a use after free of a large buffer too.
  try {
    sanitize::run_double(rng);
    sanitize::run_float(rng);
  } catch (const std::exception& err) {
    std::fprintf(stderr, "FAIL: unexpected exception: %s\n", err.what());
    ++sanitize::g_failures;
  }
  std::printf("core_sanitize: %d checks, %d failed\n", sanitize::g_checks, sanitize::g_failures);
  return sanitize::g_failures == 0 ? 0 : 1;
}
