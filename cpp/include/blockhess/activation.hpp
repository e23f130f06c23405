// Pointwise activations and their first two derivatives, entry by entry.
//   relu       max(x, 0)                          relu'(0) = 0 (torch's choice), relu'' = 0
//   gelu       x Phi(x) (the erf form)            Phi the standard normal CDF, phi its density:
//                                                 gelu' = Phi + x phi, gelu'' = phi (2 - x^2)
//   gelu_tanh  x (1 + tanh u) / 2, u = c (x + 0.044715 x^3), c = sqrt(2/pi) (GPT-2's)
//   silu       x sigma(x)                         silu' = s (1 + x (1 - s)), silu'' = s (1 - s) (2 + x (1 - 2 s))
#pragma once

#include <array>
#include <cmath>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/registry.hpp"

namespace blockhess::activation {

enum class Kind : int { relu = 0, gelu = 1, gelu_tanh = 2, silu = 3 };

// The registry: each Kind's name, in the enum's order (a Kind's code is its index). Python reads it
// (blockhess._core.activations: BlockSpec, the command lines), so an activation is named only here.
inline constexpr std::array<const char*, 4> kNames{"relu", "gelu", "gelu_tanh", "silu"};

inline Kind parse(const std::string& name) { return static_cast<Kind>(registry::parse(kNames, name, "activation")); }
inline Kind from_code(int code) { return static_cast<Kind>(registry::checked(kNames, code, "activation")); }

// Whether phi'' is zero almost everywhere (no curvature site).
inline bool is_piecewise_linear(Kind k) { return k == Kind::relu; }

// phi(x), phi'(x) and phi''(x) at once.
template <class T>
BLOCKHESS_HD void evaluate(Kind kind, T x, T* value, T* first, T* second) {
  switch (kind) {
    case Kind::relu:
      *value = x > T(0) ? x : T(0);
      *first = x > T(0) ? T(1) : T(0);
      *second = T(0);
      return;
    case Kind::gelu: {
      const T density = std::exp(-x * x / T(2)) / std::sqrt(T(2) * T(3.14159265358979323846));
      const T cdf = (T(1) + std::erf(x / std::sqrt(T(2)))) / T(2);
      *value = x * cdf;
      *first = cdf + x * density;
      *second = density * (T(2) - x * x);
      return;
    }
    case Kind::gelu_tanh: {
      // With sigma = (1 + tanh u) / 2 = 1 / (1 + e^{-2u}): 1 - tanh^2 u = 4 sigma (1 - sigma) and
      // tanh u = 2 sigma - 1. One exp is about four times cheaper than tanh, and sigma keeps full
      // relative accuracy where 1 + tanh u cancels (x far below 0).
      const T c = std::sqrt(T(2) / T(3.14159265358979323846)), k = T(0.044715);
      const T u = c * (x + k * x * x * x), du = c * (T(1) + T(3) * k * x * x), ddu = c * T(6) * k * x;
      const T sigma = T(1) / (T(1) + std::exp(T(-2) * u)), s = T(4) * sigma * (T(1) - sigma);
      *value = x * sigma;
      *first = sigma + x * s * du / T(2);
      *second = s * du + x * s * (ddu - T(2) * (T(2) * sigma - T(1)) * du * du) / T(2);
      return;
    }
    case Kind::silu: {
      const T s = T(1) / (T(1) + std::exp(-x));
      *value = x * s;
      *first = s * (T(1) + x * (T(1) - s));
      *second = s * (T(1) - s) * (T(2) + x * (T(1) - T(2) * s));
      return;
    }
  }
}

}  // namespace blockhess::activation
