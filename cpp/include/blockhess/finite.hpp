// Finiteness checks: a finite input that drives some stage past the float range must end in an
// error that names the stage, never in a result full of Inf or NaN.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "blockhess/config.hpp"

namespace blockhess {

// Raised when a stage of a computation produced Inf or NaN from finite inputs (the Python
// bindings turn it into blockhess.NonFiniteError, a ValueError).
struct non_finite_error : std::overflow_error {
  using std::overflow_error::overflow_error;
};

namespace detail {
// The bits of an IEEE float or double, and the mask of its exponent: all ones for Inf and NaN.
template <class T>
struct FloatBits {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  using type = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  static constexpr type exponent = sizeof(T) == 8 ? type(0x7ff0000000000000ull) : type(0x7f800000u);
  static type of(T x) {
    type b;
    std::memcpy(&b, &x, sizeof(T));
    return b;
  }
};
}  // namespace detail

// True unless x is Inf or NaN. Integer operations on the bits: no floating-point dependency chain,
// so loops that test every entry vectorise and run at memory speed.
template <class T>
bool is_finite(T x) {
  using Bits = detail::FloatBits<T>;
  return (Bits::of(x) & Bits::exponent) != Bits::exponent;
}

// True when none of the n values is Inf or NaN.
template <class T>
bool all_finite(const T* values, index_t n) {
  using Bits = detail::FloatBits<T>;
  typename Bits::type bad = 0;
  for (index_t k = 0; k < n; ++k)
    bad |= static_cast<typename Bits::type>((Bits::of(values[k]) & Bits::exponent) == Bits::exponent);
  return bad == 0;
}

// Throws non_finite_error naming `stage` unless all n values are finite.
template <class T>
void require_finite(const T* values, index_t n, const std::string& stage) {
  if (!all_finite(values, n))
    throw non_finite_error(stage + " is not finite (Inf or NaN) although every input is: the inputs drive it "
                           "past the range of " + (sizeof(T) == 8 ? "float64" : "float32") +
                           "; rescale them (weights or inputs of smaller magnitude)");
}

}  // namespace blockhess
