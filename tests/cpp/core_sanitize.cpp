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

#include "core_sanitize.hpp"

int main() {
  std::mt19937_64 rng(20260101);
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
