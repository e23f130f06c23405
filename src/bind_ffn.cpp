// Bindings for the FFN sublayer relu(Y W_1) W_2 (components.hpp): forward, Jacobians with respect to
// W_1, W_2 and Y, and the cross second derivative with respect to (W_1, W_2). Outputs are
// allocated in Python and written in place.
#include "binding.hpp"

#include "blockhess/components.hpp"
#include "sublayer_shapes.hpp"

namespace blockhess::bind {
namespace {

template <class T>
components::FfnDims dims_of(const carray<T>& Y, const carray<T>& W1, const carray<T>& W2) {
  return ffn_dims(dims(Y), dims(W1), dims(W2));
}

template <class T>
void bind_for(py::module_& m) {
  m.def(
      "ffn_forward",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        require_shape_of(dims(out), ffn_forward_shape(s), "out");
        const T *y = Y.data(), *w1 = W1.data(), *w2 = W2.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        components::ffn_forward(y, w1, w2, s, o);
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(),
      py::arg("out").noconvert());

  // kind (components::FfnJacobian): sublayer_shapes.hpp lists each result's shape.
  m.def(
      "ffn_jacobian",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, int kind, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        require_shape_of(dims(out), ffn_jacobian_shape(s, kind), "out");
        const T *y = Y.data(), *w1 = W1.data(), *w2 = W2.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        components::ffn_jacobian(y, w1, w2, s, static_cast<components::FfnJacobian>(kind), o);  // checked finite
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("kind"),
      py::arg("out").noconvert());

  // kind (components::FfnCross): sublayer_shapes.hpp.
  m.def(
      "ffn_cross_hessian",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, int kind, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        require_shape_of(dims(out), ffn_cross_shape(s, kind), "out");
        const T *y = Y.data(), *w1 = W1.data(), *w2 = W2.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        components::ffn_cross_hessian(y, w1, w2, s, static_cast<components::FfnCross>(kind), o);  // checked finite
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("kind"),
      py::arg("out").noconvert());
}

}  // namespace

void bind_ffn(py::module_& m) {
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });

  m.def(
      "ffn_working_memory",
      [](index_t L, index_t d, index_t f, index_t e, int kind, index_t threads) {
        if (kind < -1 || kind > 5) throw std::invalid_argument("ffn_working_memory: kind must be -1..5");
        std::optional<components::FfnJacobian> k;
        if (kind >= 0) k = static_cast<components::FfnJacobian>(kind);
        return components::ffn_working_memory<double>({L, d, f, e}, k, threads);
      },
      py::arg("L"), py::arg("d"), py::arg("d_ff"), py::arg("d_out"), py::arg("kind"), py::arg("threads"),
      "Elements ffn_forward (kind -1) or ffn_jacobian (kind 0..5) allocates besides its result (components.hpp).");
  m.def(
      "ffn_cross_working_memory",
      [](index_t L, index_t d, index_t f, index_t e, int kind, index_t threads) {
        if (kind < 0 || kind > 1) throw std::invalid_argument("ffn_cross_working_memory: kind must be 0 or 1");
        return components::ffn_cross_working_memory<double>({L, d, f, e}, static_cast<components::FfnCross>(kind),
                                                             threads);
      },
      py::arg("L"), py::arg("d"), py::arg("d_ff"), py::arg("d_out"), py::arg("kind"), py::arg("threads"),
      "Elements ffn_cross_hessian allocates besides its result (components.hpp).");
}

}  // namespace blockhess::bind
