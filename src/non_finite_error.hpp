// blockhess::non_finite_error seen from Python: blockhess.NonFiniteError (a ValueError, defined in
// python/blockhess/_errors.py). Each extension module registers it for its own copy of the type.
#pragma once

#include <exception>

#include "binding.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::bind {

inline void translate_non_finite_error(std::exception_ptr thrown) {
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const blockhess::non_finite_error& e) {
    const py::object error = py::module_::import("blockhess._errors").attr("NonFiniteError");
    PyErr_SetString(error.ptr(), e.what());
  }
}

}  // namespace blockhess::bind
