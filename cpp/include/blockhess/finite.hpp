// Finiteness checks: a finite input that drives some stage past the float range must end in an
// error that names the stage, never in a result full of Inf or NaN.
#pragma once

#include <algorithm>
#include <atomic>
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

// The exponent field of T in the 32-bit word of a value that holds it: all ones exactly for Inf
// and NaN. That word is the high one of a double and the word of a float.
template <class T>
constexpr std::uint32_t kExponentMask = sizeof(T) == 8 ? 0x7ff00000u : 0x7f800000u;

// The largest of `largest` and the n values' exponent fields: kExponentMask<T> exactly when one of
// them is Inf or NaN. The loop keeps the largest masked word, a plain unsigned 32-bit max that
// vectorises on every x86-64 level; it runs on the GPU too (the engine's row operations).
template <class T>
BLOCKHESS_HD std::uint32_t largest_exponent(const T* values, index_t n, std::uint32_t largest = 0) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  constexpr std::size_t high_word = 0;
#else
  constexpr std::size_t high_word = sizeof(T) == 8 ? 4 : 0;
#endif
  for (index_t k = 0; k < n; ++k) {
    std::uint32_t word;
    memcpy(&word, reinterpret_cast<const char*>(values + k) + high_word, 4);
    word &= kExponentMask<T>;
    largest = word > largest ? word : largest;
  }
  return largest;
}

// True when none of the n values is Inf or NaN.
template <class T>
bool all_finite(const T* values, index_t n) {
  return largest_exponent(values, n) != kExponentMask<T>;
}

// The error for a stage that came out Inf or NaN from finite inputs.
template <class T>
non_finite_error non_finite(const std::string& stage) {
  return non_finite_error(stage + " is not finite (Inf or NaN) although every input is: the inputs drive it "
                          "past the range of " + (sizeof(T) == 8 ? "float64" : "float32") +
                          "; rescale them (weights or inputs of smaller magnitude)");
}

// Throws non_finite_error naming `stage` unless all n values are finite.
template <class T>
void require_finite(const T* values, index_t n, const std::string& stage) {
  if (!all_finite(values, n)) throw non_finite<T>(stage);
}

// The same for values in a backend's memory (backend.hpp), checked where they are.
template <class T, class Backend>
void require_finite(const Backend& backend, const T* values, index_t n, const std::string& stage) {
  if (!backend.all_finite(values, n)) throw non_finite<T>(stage);
}

// Whether every value a (parallel) loop wrote is finite. Each iteration checks the piece it has
// just written, while that piece is still in cache: a separate pass over a large result would read
// all of it back from memory and cost as much as computing it. Writers take a FiniteRecord* that
// may be null (no check).
class FiniteRecord {
 public:
  template <class T>
  void check(const T* values, index_t n) {
    if (!all_finite(values, n)) ok_.store(false, std::memory_order_relaxed);
  }
  // What a check elsewhere found (a backend's all_finite).
  void note(bool finite) {
    if (!finite) ok_.store(false, std::memory_order_relaxed);
  }
  bool ok() const { return ok_.load(std::memory_order_relaxed); }

  // Throws non_finite_error naming `stage` unless every checked value was finite.
  template <class T>
  void require(const std::string& stage) const {
    if (!ok()) throw non_finite<T>(stage);
  }

 private:
  std::atomic<bool> ok_{true};
};

template <class T>
void note_finite(FiniteRecord* record, const T* values, index_t n) {
  if (record) record->check(values, n);
}

}  // namespace blockhess
