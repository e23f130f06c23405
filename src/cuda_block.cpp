// The block family's curvature on the GPU, bound into _cuda: the engine evaluates the block and
// its factors on the host (the inputs are small: Python passes host copies of X, the weights and
// the target), and writes the (P, P) Hessian into device memory through cuda::DeviceHessian. The
// same checks as _core's bindings (block_problem.hpp), the same engine, another assembly target.
#include <cstdint>
#include <vector>

#include "binding.hpp"
#include "block_problem.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/block_model.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/loss.hpp"
#include "blockhess/cuda/device_hessian.hpp"
#include "blockhess/cuda/runtime.hpp"
#include "non_finite_error.hpp"

namespace blockhess::bind {
namespace {

template <class T>
void bind_for(py::module_& m, const char* suffix) {
  using A = const carray<T>&;
  using Weights = const std::vector<carray<T>>&;
  using ptr = std::uintptr_t;

  // out: device pointer to (P, P) of T, C-contiguous; stream: the CuPy stream to queue on. Returns
  // the loss value. The Hessian is complete when the call returns (its finiteness was read back).
  m.def(
      (std::string("loss_hessian") + suffix).c_str(),
      [](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const optional_carray<std::int64_t>& classes, int part, const std::vector<bool>& wrt, ptr out, index_t P,
         ptr stream, const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        if (P != c.P) throw std::invalid_argument("blockhess._cuda: out is not (P, P) for this selection");
        if (out == 0) throw std::invalid_argument("blockhess._cuda: out is null");
        py::gil_scoped_release release;
        auto e = c.problem.evaluate(eps);
        try {
          cuda::DeviceHessian<T> H{reinterpret_cast<T*>(out), c.P, stream};
          return engine::loss_hessian_into(e.graph(), *heads::make(c.target), c.part, c.wrt, H);
        } catch (const engine::FactorsDoNotReach&) {
          // A parameter below the last block's attention: the host engine's exact products
          // (engine/loss.hpp's loss_hessian, docs/derivation.md §5.4), the result uploaded after
          // whatever the device assembly queued on the stream.
          RawBuffer<T> host(static_cast<size_t>(c.P * c.P));
          const T value = c.problem.evaluate(eps).loss_hessian(c.target, c.part, c.wrt, host.data());
          cuda::copy_to_device(reinterpret_cast<void*>(out), host.data(), sizeof(T) * static_cast<size_t>(c.P * c.P),
                               stream);
          return value;
        }
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out"), py::arg("P"), py::arg("stream"),
      py::arg("head_weight").noconvert().none(true) = py::none(), py::arg("head_bias").noconvert().none(true) = py::none());

  // d2 Z / dW_i dW_j for one sample, (L d n_i, n_j), into the device array at out: one assembly
  // per output entry into a device scratch (P, P), its (i, j) block copied out on the GPU.
  m.def(
      (std::string("block_output_hessian") + suffix).c_str(),
      [](A X, const SpecTuple& spec, Weights W, T eps, int i, int j, ptr out, ptr stream) {
        const auto p = output_hessian_problem(X, spec, W, i, j);
        if (out == 0) throw std::invalid_argument("blockhess._cuda: out is null");
        py::gil_scoped_release release;
        auto e = p.evaluate(eps);
        const index_t P = engine::pair_size(e.graph(), i, j);
        cuda::DeviceArray<T> scratch(static_cast<size_t>(P * P), stream);
        cuda::DeviceHessian<T> H{scratch.data(), P, stream};
        T* dst = reinterpret_cast<T*>(out);
        engine::output_hessians(e.graph(), i, j, H, [&](index_t o, index_t row, index_t col, index_t ni, index_t nj) {
          cuda::copy_rows(dst + o * ni * nj, sizeof(T) * nj, scratch.data() + row * P + col, sizeof(T) * P,
                          sizeof(T) * nj, static_cast<size_t>(ni), stream);
        });
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("i"), py::arg("j"),
      py::arg("out"), py::arg("stream"));
}

}  // namespace

void bind_block_device(py::module_& m) {
  // This module's non_finite_error is its own type: it becomes blockhess.NonFiniteError here too.
  py::register_local_exception_translator(translate_non_finite_error);
  bind_for<float>(m, "_f32");
  bind_for<double>(m, "_f64");
}

}  // namespace blockhess::bind
