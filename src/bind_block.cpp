#include "binding.hpp"

namespace blockhess::bind {
void bind_block(py::module_&) {}
}  // namespace blockhess::bind
