// PYBIND11_MODULE(_core): the CPU extension. Each area registers itself from its own bind_*.cpp.
#include "binding.hpp"

#include "blockhess/version.hpp"

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
  m.doc() = "blockhess CPU core (private; use the blockhess package)";
  m.attr("__cpp_version__") = BLOCKHESS_VERSION_STRING;
#if defined(_OPENMP)
  m.attr("_has_openmp") = true;
#else
  m.attr("_has_openmp") = false;
#endif
  using namespace blockhess::bind;
  bind_layernorm(m);
  bind_softmax(m);
  bind_commutation(m);
  bind_attention(m);
  bind_ffn(m);
  bind_block(m);
}
