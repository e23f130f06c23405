// PYBIND11_MODULE(_cuda): the GPU extension. Compiled by the host C++ compiler; it only calls the
// plain C++ launchers of blockhess::cuda, which take raw device pointers and a stream handle.
#include "binding.hpp"

#include "blockhess/cuda/runtime.hpp"

PYBIND11_MODULE(_cuda, m, py::mod_gil_not_used()) {
  m.doc() = "blockhess CUDA kernels (private; use the blockhess package with CuPy arrays)";
  m.def("device_count", &blockhess::cuda::device_count);
  m.def("synchronize", &blockhess::cuda::synchronize, py::arg("stream"),
        py::call_guard<py::gil_scoped_release>());
}
