// PYBIND11_MODULE(_engine_nodes): the engine's per-node test hook (bind_engine.cpp), private. A module
// of its own so that it is compiled once, at the baseline instruction-set level, rather than inside
// every instruction-set build of _core (it instantiates the whole engine for float and double again).
#include "binding.hpp"

PYBIND11_MODULE(_engine_nodes, m, py::mod_gil_not_used()) {
  m.doc() = "blockhess engine nodes, one chain at a time (private: the per-node tests drive it)";
  blockhess::bind::bind_engine(m);
}
