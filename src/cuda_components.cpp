// The sublayers on device arrays, bound into _cuda: the attention's forward pass and Jacobians, the
// FFN's forward pass, Jacobians and cross second derivative (components.hpp) on the GPU backend
// (cuda::CudaBackend) on the caller's stream, the same engine and checks as _core's bindings
// (bind_attention.cpp, bind_ffn.cpp, sublayer_shapes.hpp). A result is complete when the call
// returns: its finiteness is read back.
#include <cstdint>
#include <string>

#include "binding.hpp"
#include "blockhess/components.hpp"
#include "blockhess/cuda/backend.hpp"
#include "device_arg.hpp"
#include "sublayer_shapes.hpp"

namespace blockhess::bind {
namespace {

using ptr = std::uintptr_t;

// The sizes of a sublayer's call on device arrays, its result's shape checked against shape(sizes).
template <class Shape>
components::AttentionDims checked(const DeviceArg& X, const DeviceArg& WQ, const DeviceArg& WK, const DeviceArg& WV,
                                  const DeviceArg& out, Shape&& shape) {
  const components::AttentionDims s = attention_dims(X.second, WQ.second, WK.second, WV.second);
  if (out.first == 0) throw std::invalid_argument("blockhess._cuda: out is null");
  require_shape_of(out.second, shape(s), "out");
  return s;
}
template <class Shape>
components::FfnDims checked(const DeviceArg& Y, const DeviceArg& W1, const DeviceArg& W2, const DeviceArg& out,
                            Shape&& shape) {
  const components::FfnDims s = ffn_dims(Y.second, W1.second, W2.second);
  if (out.first == 0) throw std::invalid_argument("blockhess._cuda: out is null");
  require_shape_of(out.second, shape(s), "out");
  return s;
}

template <class T>
void bind_for(py::module_& m, const std::string& suffix) {
  const auto name = [&](const char* base) { return std::string(base) + suffix; };
  using py::arg;
  m.def(
      name("attention_forward").c_str(),
      [](const DeviceArg& X, const DeviceArg& WQ, const DeviceArg& WK, const DeviceArg& WV, const DeviceArg& out,
         ptr stream) {
        const auto s = checked(X, WQ, WK, WV, out, attention_forward_shape);
        py::gil_scoped_release release;
        const cuda::CudaBackend<T> backend(stream);
        components::attention_forward(device_data<T>(X), device_data<T>(WQ), device_data<T>(WK), device_data<T>(WV), s,
                                      device_out<T>(out), backend);
      },
      arg("X"), arg("W_Q"), arg("W_K"), arg("W_V"), arg("out"), arg("stream"));
  m.def(
      name("attention_jacobian").c_str(),
      [](const DeviceArg& X, const DeviceArg& WQ, const DeviceArg& WK, const DeviceArg& WV, int wrt,
         const DeviceArg& out, ptr stream) {
        const auto s = checked(X, WQ, WK, WV, out,
                               [wrt](const components::AttentionDims& s) { return attention_jacobian_shape(s, wrt); });
        py::gil_scoped_release release;
        const cuda::CudaBackend<T> backend(stream);
        components::attention_jacobian(device_data<T>(X), device_data<T>(WQ), device_data<T>(WK), device_data<T>(WV), s,
                                       static_cast<components::AttentionWrt>(wrt), device_out<T>(out), backend);
      },
      arg("X"), arg("W_Q"), arg("W_K"), arg("W_V"), arg("wrt"), arg("out"), arg("stream"));
  m.def(
      name("ffn_forward").c_str(),
      [](const DeviceArg& Y, const DeviceArg& W1, const DeviceArg& W2, const DeviceArg& out, ptr stream) {
        const auto s = checked(Y, W1, W2, out, ffn_forward_shape);
        py::gil_scoped_release release;
        const cuda::CudaBackend<T> backend(stream);
        components::ffn_forward(device_data<T>(Y), device_data<T>(W1), device_data<T>(W2), s,
                                device_out<T>(out), backend);
      },
      arg("Y"), arg("W_1"), arg("W_2"), arg("out"), arg("stream"));
  m.def(
      name("ffn_jacobian").c_str(),
      [](const DeviceArg& Y, const DeviceArg& W1, const DeviceArg& W2, int kind, const DeviceArg& out, ptr stream) {
        const auto s = checked(Y, W1, W2, out, [kind](const components::FfnDims& s) { return ffn_jacobian_shape(s, kind); });
        py::gil_scoped_release release;
        const cuda::CudaBackend<T> backend(stream);
        components::ffn_jacobian(device_data<T>(Y), device_data<T>(W1), device_data<T>(W2), s,
                                 static_cast<components::FfnJacobian>(kind), device_out<T>(out), backend);
      },
      arg("Y"), arg("W_1"), arg("W_2"), arg("kind"), arg("out"), arg("stream"));
  m.def(
      name("ffn_cross_hessian").c_str(),
      [](const DeviceArg& Y, const DeviceArg& W1, const DeviceArg& W2, int kind, const DeviceArg& out, ptr stream) {
        const auto s = checked(Y, W1, W2, out, [kind](const components::FfnDims& s) { return ffn_cross_shape(s, kind); });
        py::gil_scoped_release release;
        const cuda::CudaBackend<T> backend(stream);
        components::ffn_cross_hessian(device_data<T>(Y), device_data<T>(W1), device_data<T>(W2), s,
                                      static_cast<components::FfnCross>(kind), device_out<T>(out),
                                      backend);
      },
      arg("Y"), arg("W_1"), arg("W_2"), arg("kind"), arg("out"), arg("stream"));
}

}  // namespace

void bind_components_device(py::module_& m) {
  bind_for<float>(m, "_f32");
  bind_for<double>(m, "_f64");
}

}  // namespace blockhess::bind
