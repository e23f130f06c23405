// Bindings for the Transformer block: forward, Jacobians, output second derivatives, and the loss
// gradient and Hessian. X is (B, L, d) (B = 1 for the single-sample functions); weights are the
// five matrices in the order W_Q, W_K, W_V, W_1, W_2.
#include "binding.hpp"

#include <array>
#include <cstdint>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/block_hvp.hpp"
#include "blockhess/block_loss.hpp"

namespace blockhess::bind {
namespace {

template <class T>
struct Problem {
  block::Dims dims;
  index_t B = 0;
  block::Weights<T> weights;
};

template <class T>
Problem<T> problem(const carray<T>& X, const carray<T>& WQ, const carray<T>& WK, const carray<T>& WV,
                   const carray<T>& W1, const carray<T>& W2) {
  if (X.ndim() != 3) throw std::invalid_argument("block: X must be (B, L, d)");
  Problem<T> p;
  p.B = X.shape(0);
  p.dims.L = X.shape(1);
  p.dims.d = X.shape(2);
  if (WQ.ndim() != 2 || W1.ndim() != 2) throw std::invalid_argument("block: weights must be 2-D");
  p.dims.dk = WQ.shape(1);
  p.dims.dff = W1.shape(1);
  p.dims.check();
  const std::array<const carray<T>*, block::kNumParams> w{&WQ, &WK, &WV, &W1, &W2};
  for (int k = 0; k < block::kNumParams; ++k) {
    require_shape(*w[k], {p.dims.rows(k), p.dims.cols(k)}, "weight");
    p.weights.w[k] = w[k]->data();
  }
  return p;
}

block::Selection selection(const std::vector<bool>& wrt) {
  if (wrt.size() != block::kNumParams)
    throw std::invalid_argument("block: wrt needs one flag per parameter (" + std::to_string(block::kNumParams) + ")");
  block::Selection s{};
  for (int k = 0; k < block::kNumParams; ++k) s[k] = wrt[k];
  return s;
}

template <class T>
block::Target<T> target(const Problem<T>& p, int kind, const optional_carray<T>& values,
                        const optional_carray<std::int64_t>& classes) {
  if (kind != 0 && kind != 1) throw std::invalid_argument("block: unknown loss kind");
  if (values) require_shape(*values, {p.B, p.dims.L, p.dims.d}, "target");
  if (classes) {
    require_shape(*classes, {p.B, p.dims.L}, "target");
    const std::int64_t* c = classes->data();
    for (index_t k = 0; k < p.B * p.dims.L; ++k)
      if (c[k] < 0 || c[k] >= p.dims.d) throw std::invalid_argument("block: class index out of range [0, d)");
  }
  if ((kind == 0) != static_cast<bool>(values) || (kind == 1) != static_cast<bool>(classes))
    throw std::invalid_argument("block: mse needs values, cross_entropy needs classes");
  block::Target<T> t;
  t.kind = static_cast<loss::Kind>(kind);
  t.values = data_or_null(values);
  t.classes = data_or_null(classes);
  return t;
}

template <class T>
void bind_for(py::module_& m) {
  using A = const carray<T>&;
  using opt_classes = optional_carray<std::int64_t>;

  m.def(
      "block_forward",
      [](A X, A WQ, A WK, A WV, A W1, A W2, T eps, carray<T>& out) {
        const auto p = problem(X, WQ, WK, WV, W1, W2);
        require_shape(out, {p.B, p.dims.L, p.dims.d}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        const auto e = block::forward(p.dims, p.B, X.data(), p.weights, eps);
        std::copy_n(e.output(), p.B * p.dims.L * p.dims.d, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(), py::arg("W_V").noconvert(),
      py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"), py::arg("out").noconvert());

  m.def(
      "block_jacobian",
      [](A X, A WQ, A WK, A WV, A W1, A W2, T eps, int param, carray<T>& out) {
        const auto p = problem(X, WQ, WK, WV, W1, W2);
        if (p.B != 1) throw std::invalid_argument("block_jacobian: one sample only");
        if (param < 0 || param >= block::kNumParams) throw std::invalid_argument("block_jacobian: bad param");
        require_shape(out, {p.dims.L * p.dims.d, p.dims.size(param)}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = block::forward(p.dims, 1, X.data(), p.weights, eps);
        block::jacobian(e, param, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(), py::arg("W_V").noconvert(),
      py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"), py::arg("param"),
      py::arg("out").noconvert());

  m.def(
      "block_output_hessian",
      [](A X, A WQ, A WK, A WV, A W1, A W2, T eps, int i, int j, carray<T>& out) {
        const auto p = problem(X, WQ, WK, WV, W1, W2);
        if (p.B != 1) throw std::invalid_argument("block_output_hessian: one sample only");
        if (i < 0 || i >= block::kNumParams || j < 0 || j >= block::kNumParams)
          throw std::invalid_argument("block_output_hessian: bad param");
        require_shape(out, {p.dims.L * p.dims.d * p.dims.size(i), p.dims.size(j)}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        block::output_hessian(p.dims, X.data(), p.weights, eps, i, j, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(), py::arg("W_V").noconvert(),
      py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"), py::arg("i"), py::arg("j"),
      py::arg("out").noconvert());

  m.def(
      "loss_gradient",
      [](A X, A WQ, A WK, A WV, A W1, A W2, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, std::optional<carray<T>> out) {
        const auto p = problem(X, WQ, WK, WV, W1, W2);
        T* o = nullptr;
        if (out) {
          require_shape(*out, {p.dims.total_size()}, "out");
          o = mutable_ptr(*out);
        }
        const auto tgt = target<T>(p, kind, values, classes);
        py::gil_scoped_release release;
        return block::loss_gradient(p.dims, p.B, X.data(), p.weights, eps, tgt, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(), py::arg("W_V").noconvert(),
      py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
      py::arg("out").noconvert().none(true));

  m.def(
      "loss_hessian",
      [](A X, A WQ, A WK, A WV, A W1, A W2, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, carray<T>& out) {
        const auto p = problem(X, WQ, WK, WV, W1, W2);
        const auto sel = selection(wrt);
        std::array<index_t, block::kNumParams> off{};
        const index_t P = block::offsets(p.dims, sel, off);
        require_shape(out, {P, P}, "out");
        if (part < 0 || part > 2) throw std::invalid_argument("loss_hessian: bad part");
        T* o = mutable_ptr(out);
        const auto tgt = target<T>(p, kind, values, classes);
        py::gil_scoped_release release;
        return block::loss_hessian(p.dims, p.B, X.data(), p.weights, eps, tgt, static_cast<block::Part>(part), sel, o);
      },
      py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(), py::arg("W_V").noconvert(),
      py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out").noconvert());

  // The loss Hessian as an operator: the forward and reverse passes are computed once, at
  // construction; apply(V, out) writes H V for V of shape (P,) or (P, k).
  using Operator = block::HessianOperator<T>;
  // module_local: the portable and x86-64-v3 builds of the core each bind this same C++ type.
  py::class_<Operator>(m, sizeof(T) == 8 ? "HessianOperator64" : "HessianOperator32", py::module_local())
      .def(py::init([](A X, A WQ, A WK, A WV, A W1, A W2, T eps, int kind, const optional_carray<T>& values,
                       const opt_classes& classes, int part, const std::vector<bool>& wrt) {
             const auto p = problem(X, WQ, WK, WV, W1, W2);
             const auto sel = selection(wrt);
             if (part < 0 || part > 2) throw std::invalid_argument("HessianOperator: bad part");
             const auto tgt = target<T>(p, kind, values, classes);
             py::gil_scoped_release release;
             return new Operator(p.dims, p.B, X.data(), p.weights, eps, tgt, static_cast<block::Part>(part), sel);
           }),
           py::arg("X").noconvert(), py::arg("W_Q").noconvert(), py::arg("W_K").noconvert(),
           py::arg("W_V").noconvert(), py::arg("W_1").noconvert(), py::arg("W_2").noconvert(), py::arg("eps"),
           py::arg("kind"), py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
           py::arg("part"), py::arg("wrt"))
      .def_property_readonly("size", &Operator::size)
      .def_property_readonly("loss_value", &Operator::loss_value)
      .def(
          "apply",
          [](const Operator& op, const carray<T>& V, carray<T>& out) {
            const index_t P = op.size();
            if (V.ndim() < 1 || V.ndim() > 2 || V.shape(0) != P) throw std::invalid_argument("apply: V must be (P,) or (P, k)");
            const index_t k = V.ndim() == 2 ? V.shape(1) : 1;
            if (out.ndim() != V.ndim() || out.shape(0) != P || (V.ndim() == 2 && out.shape(1) != k))
              throw std::invalid_argument("apply: out must have the shape of V");
            T* o = mutable_ptr(out);
            py::gil_scoped_release release;
            op.apply_columns(V.data(), k, o);
          },
          py::arg("V").noconvert(), py::arg("out").noconvert());
}

}  // namespace

void bind_block(py::module_& m) {
  m.def(
      "block_parameters",
      [](index_t d, index_t dk, index_t dff) {
        const block::Dims D{1, d, dk, dff};
        D.check();
        py::list table;
        for (int p = 0; p < block::kNumParams; ++p)
          table.append(py::make_tuple(block::kParamNames[p], py::make_tuple(D.rows(p), D.cols(p))));
        return table;
      },
      "The block's parameters in order: [(name, (rows, cols))] for widths d, d_k, d_ff (params.hpp).",
      py::arg("d"), py::arg("d_k"), py::arg("d_ff"));
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });
}

}  // namespace blockhess::bind
