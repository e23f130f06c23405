#include "binding.hpp"

namespace blockhess::bind {
void bind_softmax(py::module_&) {}
}  // namespace blockhess::bind
