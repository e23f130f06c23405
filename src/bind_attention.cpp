#include "binding.hpp"

namespace blockhess::bind {
void bind_attention(py::module_&) {}
}  // namespace blockhess::bind
