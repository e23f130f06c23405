// The core's finiteness checks, seen from Python: blockhess::non_finite_error becomes
// blockhess.NonFiniteError (non_finite_error.hpp), and all_finite is the check that the Python layer
// applies to results.
#include "binding.hpp"

#include <exception>

#include "blockhess/finite.hpp"
#include "non_finite_error.hpp"

namespace blockhess::bind {

void bind_checks(py::module_& m) {
  py::register_exception_translator(translate_non_finite_error);
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
