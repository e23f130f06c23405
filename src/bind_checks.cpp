// The core's finiteness checks, seen from Python: blockhess::non_finite_error becomes
// blockhess.NonFiniteError (a ValueError, defined in python/blockhess/_errors.py), and all_finite
// is the check that the Python layer applies to results.
#include "binding.hpp"

#include <exception>

#include "blockhess/finite.hpp"

namespace blockhess::bind {

void bind_checks(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const blockhess::non_finite_error& e) {
      const py::object error = py::module_::import("blockhess._errors").attr("NonFiniteError");
      PyErr_SetString(error.ptr(), e.what());
    }
  });
  for_each_float([&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    m.def(
        "all_finite",
        [](const carray<T>& a) {
          const T* p = a.data();
          const index_t n = a.size();
          py::gil_scoped_release release;
          return blockhess::all_finite(p, n);
        },
        py::arg("a").noconvert());
  });
}

}  // namespace blockhess::bind
