// A device array as Python passes it to _cuda's bindings: its pointer and shape (C-contiguous, of
// the call's dtype), so that they check it as _core's check a host array.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "blockhess/config.hpp"

namespace blockhess::bind {

using DeviceArg = std::pair<std::uintptr_t, std::vector<index_t>>;

template <class U>
const U* device_data(const DeviceArg& a) {
  return reinterpret_cast<const U*>(a.first);
}
template <class U>
U* device_out(const DeviceArg& a) {
  return reinterpret_cast<U*>(a.first);
}

}  // namespace blockhess::bind
