// Bindings for single-head self-attention (components.hpp): forward and the Jacobians with respect
// to W_Q, W_K, W_V and X. Outputs are allocated in Python and written in place.
#include "binding.hpp"

#include "blockhess/components.hpp"
#include "sublayer_shapes.hpp"

namespace blockhess::bind {
namespace {

template <class T>
components::AttentionDims dims_of(const carray<T>& X, const carray<T>& WQ, const carray<T>& WK, const carray<T>& WV) {
  return attention_dims(dims(X), dims(WQ), dims(WK), dims(WV));
}

template <class T>
void bind_for(py::module_& m) {
  m.def(
      "attention_forward",
      [](const carray<T>& X, const carray<T>& WQ, const carray<T>& WK, const carray<T>& WV, carray<T>& out) {
        const auto s = dims_of(X, WQ, WK, WV);
        require_shape_of(dims(out), attention_forward_shape(s), "out");
        const T *x = X.data(), *wq = WQ.data(), *wk = WK.data(), *wv = WV.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        components::attention_forward(x, wq, wk, wv, s, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(),
      py::arg("W_V").noconvert(), py::arg("out").noconvert());

  // wrt: 0 = W_Q, 1 = W_K, 2 = W_V, 3 = X; out (L d_v, n_wrt)
  m.def(
      "attention_jacobian",
      [](const carray<T>& X, const carray<T>& WQ, const carray<T>& WK, const carray<T>& WV, int wrt,
         carray<T>& out) {
        const auto s = dims_of(X, WQ, WK, WV);
        require_shape_of(dims(out), attention_jacobian_shape(s, wrt), "out");
        const auto w = static_cast<components::AttentionWrt>(wrt);
        const T *x = X.data(), *wq = WQ.data(), *wk = WK.data(), *wv = WV.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        components::attention_jacobian(x, wq, wk, wv, s, w, o);  // checked finite
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(),
      py::arg("W_V").noconvert(), py::arg("wrt"), py::arg("out").noconvert());
}

}  // namespace

void bind_attention(py::module_& m) {
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });

  m.def(
      "attention_working_memory",
      [](index_t L, index_t d, index_t dk, index_t dv, int wrt, index_t threads) {
        if (wrt < -1 || wrt > 3) throw std::invalid_argument("attention_working_memory: wrt must be -1..3");
        std::optional<components::AttentionWrt> w;
        if (wrt >= 0) w = static_cast<components::AttentionWrt>(wrt);
        return components::attention_working_memory<double>({L, d, dk, dv}, w, threads);
      },
      py::arg("L"), py::arg("d"), py::arg("d_k"), py::arg("d_v"), py::arg("wrt"), py::arg("threads"),
      "Elements attention_forward (wrt -1) or attention_jacobian (wrt 0..3) allocates besides its result "
      "(components.hpp).");
}

}  // namespace blockhess::bind
