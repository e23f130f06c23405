// PYBIND11_MODULE(_cuda): the GPU extension. Compiled by the host C++ compiler; it only calls the
// plain C++ launchers of blockhess::cuda, which take raw device pointers and a stream handle.
//
// Every kernel entry point is `<name>_f32` / `<name>_f64` and takes device pointers as integers
// (0 = null), sizes, scalars and the stream (CuPy's `cupy.cuda.get_current_stream().ptr`). The
// launches are asynchronous and run with the GIL released. The Python layer (blockhess._gpu_launch)
// owns allocation, dtype and layout; these functions trust the pointers they get.
#include "binding.hpp"

#include <cstdint>
#include <string>

#include "blockhess/cuda/assembly.hpp"
#include "blockhess/cuda/layernorm.hpp"
#include "blockhess/cuda/runtime.hpp"
#include "blockhess/cuda/softmax.hpp"

namespace {

namespace bc = blockhess::cuda;
using blockhess::index_t;
using ptr = std::uintptr_t;

template <class T>
T* P(ptr p) {
  return reinterpret_cast<T*>(p);
}
template <class T>
const T* C(ptr p) {
  return reinterpret_cast<const T*>(p);
}

template <class T>
void bind_for(py::module_& m, const std::string& suffix) {
  const auto name = [&](const char* base) { return std::string(base) + suffix; };
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  using py::arg;

  // ---- LayerNorm ----
  m.def(
      name("layernorm_forward").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, ptr beta, ptr Z, ptr sigma, ptr stream) {
        bc::layernorm::forward<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma), C<T>(beta), P<T>(Z), P<T>(sigma),
                                  stream);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("beta"), arg("Z"), arg("sigma"), arg("stream"),
      nogil);
  m.def(
      name("layernorm_jacobian_blocks").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, int kind, ptr out, ptr sigma, ptr stream,
         index_t tile_elems) {
        if (kind < 0 || kind > 2) throw std::invalid_argument("layernorm_jacobian_blocks: kind must be 0, 1 or 2");
        bc::layernorm::jacobian_blocks<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma),
                                          static_cast<bc::layernorm::Slab>(kind), P<T>(out), P<T>(sigma), stream,
                                          tile_elems);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("kind"), arg("out"), arg("sigma"), arg("stream"),
      arg("tile_elems") = 0, nogil);
  m.def(
      name("layernorm_jacobian_dense").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, ptr out, ptr sigma, ptr stream) {
        bc::layernorm::jacobian_dense<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma), P<T>(out), P<T>(sigma),
                                         stream);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("out"), arg("sigma"), arg("stream"), nogil);
  m.def(
      name("layernorm_hessian_blocks").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, ptr out, ptr sigma, ptr stream) {
        bc::layernorm::hessian_blocks<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma), P<T>(out), P<T>(sigma),
                                         stream);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("out"), arg("sigma"), arg("stream"), nogil);
  m.def(
      name("layernorm_hessian_dense").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, ptr out, ptr sigma, ptr stream) {
        bc::layernorm::hessian_dense<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma), P<T>(out), P<T>(sigma),
                                        stream);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("out"), arg("sigma"), arg("stream"), nogil);
  m.def(
      name("layernorm_hessian_contract").c_str(),
      [](ptr X, index_t L, index_t d, double eps, ptr gamma, ptr G, ptr out, ptr sigma, ptr stream) {
        bc::layernorm::hessian_contract<T>(C<T>(X), L, d, static_cast<T>(eps), C<T>(gamma), C<T>(G), P<T>(out),
                                           P<T>(sigma), stream);
      },
      arg("X"), arg("L"), arg("d"), arg("eps"), arg("gamma"), arg("G"), arg("out"), arg("sigma"), arg("stream"),
      nogil);

  // ---- softmax ----
  m.def(
      name("softmax_forward").c_str(),
      [](ptr Tm, index_t rows, index_t n, ptr A, ptr stream) { bc::softmax::forward<T>(C<T>(Tm), rows, n, P<T>(A), stream); },
      arg("T"), arg("m"), arg("n"), arg("A"), arg("stream"), nogil);
  m.def(
      name("softmax_jacobian_blocks").c_str(),
      [](ptr A, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::jacobian_blocks<T>(C<T>(A), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
  m.def(
      name("softmax_jacobian_dense").c_str(),
      [](ptr A, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::jacobian_dense<T>(C<T>(A), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
  m.def(
      name("softmax_hessian_blocks").c_str(),
      [](ptr A, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::hessian_blocks<T>(C<T>(A), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
  m.def(
      name("softmax_hessian_dense").c_str(),
      [](ptr A, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::hessian_dense<T>(C<T>(A), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
  m.def(
      name("softmax_hessian_contract").c_str(),
      [](ptr A, ptr G, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::hessian_contract<T>(C<T>(A), C<T>(G), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("G"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
  m.def(
      name("softmax_vjp").c_str(),
      [](ptr A, ptr G, index_t rows, index_t n, ptr out, ptr stream) {
        bc::softmax::vjp<T>(C<T>(A), C<T>(G), rows, n, P<T>(out), stream);
      },
      arg("A"), arg("G"), arg("m"), arg("n"), arg("out"), arg("stream"), nogil);

  // ---- structured assembly ----
  m.def(
      name("commute").c_str(),
      [](ptr v, index_t rows, index_t n, index_t cols, ptr out, ptr stream) {
        bc::assembly::commute<T>(C<T>(v), rows, n, cols, P<T>(out), stream);
      },
      arg("v"), arg("m"), arg("n"), arg("cols"), arg("out"), arg("stream"), nogil);
  m.def(
      name("commutation_dense").c_str(),
      [](index_t rows, index_t n, ptr out, ptr stream) { bc::assembly::commutation_dense<T>(rows, n, P<T>(out), stream); },
      arg("m"), arg("n"), arg("out"), arg("stream"), nogil);
}

}  // namespace

PYBIND11_MODULE(_cuda, m, py::mod_gil_not_used()) {
  m.doc() = "blockhess CUDA kernels (private; use the blockhess package with CuPy arrays)";
  m.def("device_count", &blockhess::cuda::device_count);
  m.def("synchronize", &blockhess::cuda::synchronize, py::arg("stream"),
        py::call_guard<py::gil_scoped_release>());
  bind_for<float>(m, "_f32");
  bind_for<double>(m, "_f64");
  blockhess::bind::bind_block_device(m);
  blockhess::bind::bind_components_device(m);
}
