// Bindings for the FFN sublayer relu(Y W_1) W_2: forward, Jacobians with respect to W_1, W_2 and Y,
// and the cross second derivative with respect to (W_1, W_2). Outputs are allocated in Python.
#include "binding.hpp"

#include "blockhess/ffn.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::bind {
namespace {

template <class T>
ffn::Dims dims_of(const carray<T>& Y, const carray<T>& W1, const carray<T>& W2) {
  if (Y.ndim() != 2 || W1.ndim() != 2 || W2.ndim() != 2)
    throw std::invalid_argument("ffn: Y, W_1 and W_2 must be 2-D");
  const ffn::Dims s{Y.shape(0), Y.shape(1), W1.shape(1), W2.shape(1)};
  require_shape(W1, {s.d, s.f}, "W_1");
  require_shape(W2, {s.f, s.e}, "W_2");
  return s;
}

template <class T>
void bind_for(py::module_& m) {
  m.def(
      "ffn_forward",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        require_shape(out, {s.L, s.e}, "out");
        const T *y = Y.data(), *w1 = W1.data(), *w2 = W2.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        ffn::forward(y, w1, w2, s, o);
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(),
      py::arg("out").noconvert());

  // kind: 0 = W_1 (L e, d f), 1 = W_2 (L e, f e), 2 = Y dense (L e, L d), 3 = Y blocks (L, e, d),
  //       4 = W_1 Kronecker factor (L, e, f), 5 = W_2 Kronecker factor relu(Y W_1) (L, f)
  m.def(
      "ffn_jacobian",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, int kind, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        switch (kind) {
          case 0: require_shape(out, {s.L * s.e, s.d * s.f}, "out"); break;
          case 1: require_shape(out, {s.L * s.e, s.f * s.e}, "out"); break;
          case 2: require_shape(out, {s.L * s.e, s.L * s.d}, "out"); break;
          case 3: require_shape(out, {s.L, s.e, s.d}, "out"); break;
          case 4: require_shape(out, {s.L, s.e, s.f}, "out"); break;
          case 5: require_shape(out, {s.L, s.f}, "out"); break;
          default: throw std::invalid_argument("ffn_jacobian: unknown kind");
        }
        const T *y = Y.data(), *w1 = W1.data(), *w2 = W2.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        // Checked finite as written; the W_1 factor relu'(H) W_2 is finite whenever W_2 is.
        FiniteRecord finite;
        switch (kind) {
          case 0: ffn::jacobian_w1(y, w1, w2, s, o, &finite); break;
          case 1: ffn::jacobian_w2(y, w1, s, o, &finite); break;
          case 2: ffn::jacobian_y_dense(y, w1, w2, s, o, &finite); break;
          case 4: ffn::jacobian_w1_factor(y, w1, w2, s, o); break;
          case 5:
            ffn::activations(y, w1, s, o);
            finite.check(o, s.L * s.f);
            break;
          default: ffn::jacobian_y_blocks(y, w1, w2, s, o, &finite); break;
        }
        static const char* const stage[] = {"the FFN Jacobian with respect to W_1", "the FFN Jacobian with respect to W_2",
                                            "the FFN Jacobian with respect to Y", "the FFN Jacobian with respect to Y (blocks)",
                                            "the Kronecker factors of the FFN Jacobian with respect to W_1",
                                            "the Kronecker factors of the FFN Jacobian with respect to W_2"};
        finite.require<T>(stage[kind]);
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("kind"),
      py::arg("out").noconvert());

  // kind: 0 = blocks (L, d, f), 1 = dense ((L e d f), f e)
  m.def(
      "ffn_cross_hessian",
      [](const carray<T>& Y, const carray<T>& W1, const carray<T>& W2, int kind, carray<T>& out) {
        const auto s = dims_of(Y, W1, W2);
        if (kind == 0)
          require_shape(out, {s.L, s.d, s.f}, "out");
        else if (kind == 1)
          require_shape(out, {s.L * s.e * s.d * s.f, s.f * s.e}, "out");
        else
          throw std::invalid_argument("ffn_cross_hessian: unknown kind");
        const T *y = Y.data(), *w1 = W1.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        if (kind == 0)
          ffn::cross_hessian_blocks(y, w1, s, o);
        else
          ffn::cross_hessian_dense(y, w1, s, o);
      },
      py::arg("Y").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("kind"),
      py::arg("out").noconvert());
}

}  // namespace

void bind_ffn(py::module_& m) {
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });
}

}  // namespace blockhess::bind
