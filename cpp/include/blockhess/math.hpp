// The few <cmath> functions that code shared with the CUDA kernels calls: std:: on the host, the
// CUDA math library (which overloads them for float and double) in device code.
#pragma once

#include <cmath>
#include <limits>

#include "blockhess/config.hpp"

namespace blockhess::math {

#if defined(__CUDA_ARCH__)
#define BLOCKHESS_MATH(f) ::f
#else
#define BLOCKHESS_MATH(f) std::f
#endif

template <class T>
BLOCKHESS_HD T sqrt(T x) { return BLOCKHESS_MATH(sqrt)(x); }
template <class T>
BLOCKHESS_HD T abs(T x) { return BLOCKHESS_MATH(fabs)(x); }
template <class T>
BLOCKHESS_HD T hypot(T x, T y) { return BLOCKHESS_MATH(hypot)(x, y); }
template <class T>
BLOCKHESS_HD bool isfinite(T x) { return BLOCKHESS_MATH(isfinite)(x); }
// x * 2^k, exact unless the result leaves the normal range.
template <class T>
BLOCKHESS_HD T ldexp(T x, int k) { return BLOCKHESS_MATH(ldexp)(x, k); }
// The binary exponent k of x > 0, with x * 2^-k in [0.5, 1); 0 for x == 0.
template <class T>
BLOCKHESS_HD int exponent(T x) {
  int k = 0;
  (void)BLOCKHESS_MATH(frexp)(x, &k);
  return k;
}

// +inf (numeric_limits is host-only in device code).
template <class T>
BLOCKHESS_HD T infinity() {
#if defined(__CUDA_ARCH__)
  return static_cast<T>(__longlong_as_double(0x7ff0000000000000LL));
#else
  return std::numeric_limits<T>::infinity();
#endif
}

#undef BLOCKHESS_MATH

}  // namespace blockhess::math
