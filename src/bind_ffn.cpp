#include "binding.hpp"

namespace blockhess::bind {
void bind_ffn(py::module_&) {}
}  // namespace blockhess::bind
