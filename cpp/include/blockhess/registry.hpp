// A registry: the names of one kind of choice (activations, norms, norm positions, losses) in a
// fixed order, a name's code its index. The core keeps each list once, beside what the names
// select; Python, the command lines and the torch reference read them from _core.
#pragma once

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace blockhess::registry {

// The code of `name`, or invalid_argument naming the kind and every choice.
template <std::size_t N>
int parse(const std::array<const char*, N>& names, const std::string& name, const char* kind) {
  std::string known;
  for (std::size_t k = 0; k < N; ++k) {
    if (name == names[k]) return static_cast<int>(k);
    known += (k ? ", " : "") + std::string(names[k]);
  }
  throw std::invalid_argument(std::string(kind) + ": unknown '" + name + "' (one of " + known + ")");
}

// `code` checked against the registry: invalid_argument for one it does not have.
template <std::size_t N>
int checked(const std::array<const char*, N>& /*names*/, int code, const char* kind) {
  if (code < 0 || code >= static_cast<int>(N))
    throw std::invalid_argument(std::string(kind) + ": unknown code " + std::to_string(code));
  return code;
}

}  // namespace blockhess::registry
