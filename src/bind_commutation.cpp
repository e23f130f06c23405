#include "binding.hpp"

namespace blockhess::bind {
void bind_commutation(py::module_&) {}
}  // namespace blockhess::bind
