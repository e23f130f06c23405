// The block family's curvature on the GPU, bound into _cuda, with the same checks as _core's
// bindings (block_problem.hpp) and the same engine:
//   - the forward pass, the loss, its gradient and Hessian-vector products (and the Hessian as an
//     operator) of a block or a model on the GPU backend (cuda::CudaBackend), on the caller's device
//     arrays, which Python passes as (pointer, shape);
//   - dense Hessians, whose factors still run on the host (docs/backends.md): the engine evaluates
//     the block from host copies of the (small) inputs and writes the (P, P) Hessian into device
//     memory through cuda::DeviceHessian.
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "block_problem.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/block_model.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/loss.hpp"
#include "blockhess/heads.hpp"
#include "blockhess/cuda/backend.hpp"
#include "blockhess/cuda/device_hessian.hpp"
#include "blockhess/cuda/runtime.hpp"
#include "device_arg.hpp"
#include "non_finite_error.hpp"

namespace blockhess::bind {
namespace {

using ptr = std::uintptr_t;

template <class U>
ArrayShape<U> on_device(const DeviceArg& a) {
  return {a.second, device_data<U>(a)};
}

template <class U>
std::optional<ArrayShape<U>> on_device(const std::optional<DeviceArg>& a) {
  return a ? std::optional<ArrayShape<U>>(on_device<U>(*a)) : std::nullopt;
}

// A model on device arrays: its problem (X, or a language model's token ids, and the weights,
// checked as _core checks them) and the backend on the caller's stream (and device), which the
// problem runs on.
template <class T>
struct DeviceProblem {
  std::unique_ptr<cuda::CudaBackend<T>> backend;
  std::vector<std::int64_t> ids;  // a language model's token ids, read back: its embedding groups them on the host
  Problem<T> problem;
};

template <class T>
DeviceProblem<T> device_problem(const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, ptr stream) {
  const bool tokens = stack_of(spec).reads_tokens();
  DeviceProblem<T> d;
  if (tokens) {
    index_t count = 1;
    for (const index_t n : X.second) count *= n;
    d.ids.resize(static_cast<size_t>(count));
    cuda::copy_to_host(d.ids.data(), reinterpret_cast<const void*>(X.first), sizeof(std::int64_t) * d.ids.size(), stream);
  }
  std::vector<ArrayShape<T>> weights;
  for (const DeviceArg& w : W) weights.push_back(on_device<T>(w));
  d.problem = problem_of<T>(X.second, tokens ? nullptr : on_device<T>(X).data, tokens ? d.ids.data() : nullptr, spec,
                            weights);
  d.backend = std::make_unique<cuda::CudaBackend<T>>(stream);
  d.problem.backend = d.backend.get();
  return d;
}

// A loss call on device arrays: a model's (its backend and ids as above) with its selection, part
// and target (mse's values or the classes of a cross-entropy, whose range the head checks, and a
// pooled head's W_C, b_C).
template <class T>
struct DeviceCall {
  std::unique_ptr<cuda::CudaBackend<T>> backend;
  std::vector<std::int64_t> ids;
  CurvatureCall<T> call;
};

template <class T>
DeviceCall<T> device_call(const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, int kind,
                          const std::optional<DeviceArg>& values, const std::optional<DeviceArg>& classes, int part,
                          const std::vector<bool>& wrt, const std::optional<DeviceArg>& head_weight,
                          const std::optional<DeviceArg>& head_bias, ptr stream) {
  DeviceProblem<T> model = device_problem<T>(X, spec, W, stream);
  DeviceCall<T> d{std::move(model.backend), std::move(model.ids), curvature_call_of(std::move(model.problem), wrt, part)};
  d.call.target = target_of<T>(d.call.problem, kind, on_device<T>(values), on_device<std::int64_t>(classes),
                               on_device<T>(head_weight), on_device<T>(head_bias));
  return d;
}

// The loss Hessian (or its part) as an operator on the GPU: its backend, and the engine's operator
// over a model whose forward and reverse passes ran at construction, on the backend's stream.
template <class T>
class DeviceOperator {
 public:
  // storage: copies of X and the weights kept (an operator), or the caller's read in place (one call).
  DeviceOperator(DeviceCall<T>&& c, T eps, engine::Storage storage = engine::Storage::copy)
      : backend_(std::move(c.backend)),
        op_(storage == engine::Storage::copy ? c.call.problem.evaluate_kept(eps) : c.call.problem.evaluate(eps),
            c.call.target, c.call.part, c.call.wrt) {}
  index_t size() const { return op_.size(); }
  T loss_value() const { return op_.loss_value(); }
  std::uintptr_t stream() const { return backend_->stream(); }
  // Row j of out (k, P) = H row j of V (k, P): the k products one after another on the stream.
  void apply(const T* V, index_t k, T* out) const {
    for (index_t j = 0; j < k; ++j) op_.apply(V + j * size(), out + j * size());
  }

 private:
  std::unique_ptr<cuda::CudaBackend<T>> backend_;  // before op_: it outlives the model
  block::LossHessianOperator<T> op_;
};

template <class T>
void bind_for(py::module_& m, const char* suffix) {
  using Weights = const std::vector<carray<T>>&;
  using OptionalDevice = const std::optional<DeviceArg>&;

  // The model's output Z (B, L, its output's width) into the device array at out, on the GPU
  // backend: its forward pass, queued on `stream`.
  m.def(
      (std::string("block_forward") + suffix).c_str(),
      [](const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, T eps, ptr out, ptr stream) {
        py::gil_scoped_release release;
        const DeviceProblem<T> d = device_problem<T>(X, spec, W, stream);
        if (out == 0) throw std::invalid_argument("blockhess._cuda: out is null");
        block::Model<T> model = d.problem.evaluate(eps);
        model.graph().copy(model.output(), reinterpret_cast<T*>(out), d.problem.B * d.problem.dims.L * d.problem.output_width());
      },
      py::arg("X"), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("out"), py::arg("stream"));

  // dZ/dW_p of one sample into the device array at out (L width(Z), n_p), on the GPU backend, queued
  // on `stream`: from its factors, or a forward tangent per entry where they do not reach it.
  m.def(
      (std::string("block_jacobian") + suffix).c_str(),
      [](const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, T eps, int param, ptr out,
         ptr stream) {
        py::gil_scoped_release release;
        const DeviceProblem<T> d = device_problem<T>(X, spec, W, stream);
        if (d.problem.B != 1) throw std::invalid_argument("block_jacobian: one sample only");
        if (param < 0 || param >= static_cast<int>(d.problem.shapes().size()))
          throw std::invalid_argument("block_jacobian: bad param");
        if (out == 0) throw std::invalid_argument("blockhess._cuda: out is null");
        d.problem.evaluate(eps).jacobian(param, reinterpret_cast<T*>(out));
      },
      py::arg("X"), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("param"), py::arg("out"),
      py::arg("stream"));

  // The loss on device arrays, and its gradient (every parameter, P entries) into the device array
  // at grad (0: the loss alone); queued on `stream`, done when it returns (the loss is read back).
  m.def(
      (std::string("loss_gradient") + suffix).c_str(),
      [](const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, T eps, int kind,
         OptionalDevice values, OptionalDevice classes, OptionalDevice head_weight, OptionalDevice head_bias, ptr grad,
         ptr stream) {
        const std::vector<bool> every(block::parameters(spec_of(spec), block::Dims{1, 1, 1, 1, 1}, stack_of(spec)).size(),
                                      true);
        py::gil_scoped_release release;
        const DeviceCall<T> d = device_call<T>(X, spec, W, kind, values, classes, 0, every, head_weight, head_bias, stream);
        return d.call.problem.evaluate(eps).loss_gradient(d.call.target, reinterpret_cast<T*>(grad));
      },
      py::arg("X"), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"), py::arg("values").none(true),
      py::arg("classes").none(true), py::arg("head_weight").none(true), py::arg("head_bias").none(true), py::arg("grad"),
      py::arg("stream"));

  // H V on device arrays, V and out (k, P) row-major (a product a row), the weights read in place.
  m.def(
      (std::string("loss_hvp") + suffix).c_str(),
      [](const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, T eps, int kind,
         OptionalDevice values, OptionalDevice classes, OptionalDevice head_weight, OptionalDevice head_bias, int part,
         const std::vector<bool>& wrt, ptr V, index_t k, ptr out, ptr stream) {
        py::gil_scoped_release release;
        if (V == 0 || out == 0) throw std::invalid_argument("blockhess._cuda: V or out is null");
        DeviceOperator<T>(device_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias, stream), eps,
                          engine::Storage::borrow)
            .apply(reinterpret_cast<const T*>(V), k, reinterpret_cast<T*>(out));
      },
      py::arg("X"), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"), py::arg("values").none(true),
      py::arg("classes").none(true), py::arg("head_weight").none(true), py::arg("head_bias").none(true), py::arg("part"),
      py::arg("wrt"), py::arg("V"), py::arg("k"), py::arg("out"),
      py::arg("stream"));

  // The operator: its forward and reverse passes at construction (copies of X and the weights kept
  // in device memory); apply(V, k, out) writes H V for V, out (k, P) on the GPU, on its stream.
  using Operator = DeviceOperator<T>;
  py::class_<Operator>(m, (std::string("HessianOperator") + suffix).c_str())
      .def(py::init([](const DeviceArg& X, const SpecTuple& spec, const std::vector<DeviceArg>& W, T eps, int kind,
                       OptionalDevice values, OptionalDevice classes, OptionalDevice head_weight,
                       OptionalDevice head_bias, int part, const std::vector<bool>& wrt, ptr stream) {
             py::gil_scoped_release release;
             return new Operator(
                 device_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias, stream), eps);
           }),
           py::arg("X"), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
           py::arg("values").none(true), py::arg("classes").none(true), py::arg("head_weight").none(true),
           py::arg("head_bias").none(true), py::arg("part"), py::arg("wrt"),
           py::arg("stream"))
      .def_property_readonly("size", &Operator::size)
      .def_property_readonly("loss_value", &Operator::loss_value)
      .def_property_readonly("stream", &Operator::stream)
      .def(
          "apply",
          [](const Operator& op, ptr V, index_t k, ptr out) {
            if (V == 0 || out == 0) throw std::invalid_argument("blockhess._cuda: V or out is null");
            py::gil_scoped_release release;
            op.apply(reinterpret_cast<const T*>(V), k, reinterpret_cast<T*>(out));
          },
          py::arg("V"), py::arg("k"), py::arg("out"));

  // out: device pointer to (P, P) of T, C-contiguous; stream: the CuPy stream to queue on. Returns
  // the loss value. The Hessian is complete when the call returns (its finiteness was read back).
  m.def(
      (std::string("loss_hessian") + suffix).c_str(),
      [](const py::array& X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
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
      [](const py::array& X, const SpecTuple& spec, Weights W, T eps, int i, int j, ptr out, ptr stream) {
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
  py::register_local_exception<engine::RunsOnHost>(m, "RunsOnHost", PyExc_ValueError);
  bind_for<float>(m, "_f32");
  bind_for<double>(m, "_f64");
}

}  // namespace blockhess::bind
