// Bindings for the Transformer block family: forward, Jacobians, output second derivatives, and the
// loss gradient, Hessian and Hessian operator. X is (B, L, d) (B = 1 for the single-sample
// functions); spec is the block (params.hpp's Spec as a tuple); weights holds one array per
// parameter, in the registry's canonical order (vectors 1-D).
#include "binding.hpp"

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/block_hvp.hpp"
#include "blockhess/block_loss.hpp"

namespace blockhess::bind {
namespace {

// The spec as Python passes it (spec.py's BlockSpec._core): (pre_ln, rmsnorm, norm_affine, bias,
// heads, out_proj, activation, causal, attention_only).
using SpecTuple = std::tuple<bool, bool, bool, bool, index_t, bool, int, bool, bool>;

block::Spec spec_of(const SpecTuple& t) {
  block::Spec s;
  std::tie(s.pre_ln, s.rmsnorm, s.norm_affine, s.bias, s.heads, s.out_proj, std::ignore, s.causal, s.attention_only) = t;
  const int act = std::get<6>(t);
  if (act < 0 || act > 3) throw std::invalid_argument("block: unknown activation code");
  s.activation = static_cast<activation::Kind>(act);
  return s;
}

template <class T>
struct Problem {
  block::Spec spec;
  block::Dims dims;
  index_t B = 0;
  std::vector<const T*> weights;

  // The block at X, for one call: the weights are the caller's arrays, alive until it returns.
  block::Evaluation<T> evaluate(const T* X, T eps) const {
    return block::forward(spec, dims, B, X, weights, eps, engine::Storage::borrow);
  }
  // For an object that outlives the call (the Hessian operator): a copy of the weights.
  block::Evaluation<T> evaluate_kept(const T* X, T eps) const { return block::forward(spec, dims, B, X, weights, eps); }
  std::vector<block::ParamShape> shapes() const { return block::parameters(spec, dims); }
};

// The sizes from X and the weights (d_k from W_Q, d_v from W_V, d_ff from W_1; 0 for an
// attention-only block, which has none), then every shape checked against the registry.
template <class T>
Problem<T> problem(const carray<T>& X, const SpecTuple& spec, const std::vector<carray<T>>& weights) {
  if (X.ndim() != 3) throw std::invalid_argument("block: X must be (B, L, d)");
  Problem<T> p;
  p.spec = spec_of(spec);
  p.B = X.shape(0);
  p.dims.L = X.shape(1);
  p.dims.d = X.shape(2);
  const auto names = block::parameters(p.spec, block::Dims{1, 1, 1, 1, 1});
  if (weights.size() != names.size())
    throw std::invalid_argument("block: " + std::to_string(names.size()) + " parameters expected, got " +
                                std::to_string(weights.size()));
  auto cols_of = [&](const char* name) {
    for (size_t k = 0; k < names.size(); ++k)
      if (names[k].name == name) {
        if (weights[k].ndim() != 2) throw std::invalid_argument(std::string("block: ") + name + " must be 2-D");
        return static_cast<index_t>(weights[k].shape(1));
      }
    throw std::logic_error("block: no parameter named " + std::string(name));
  };
  if (p.spec.heads < 1) throw std::invalid_argument("block: heads must be >= 1");
  p.dims.dk = cols_of("W_Q") / p.spec.heads;
  p.dims.dv = cols_of("W_V") / p.spec.heads;
  p.dims.dff = p.spec.attention_only ? 0 : cols_of("W_1");
  block::check(p.spec, p.dims);
  const auto shapes = p.shapes();
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto& s = shapes[k];
    if (s.vector) require_shape(weights[k], {s.cols}, s.name.c_str());
    else require_shape(weights[k], {s.rows, s.cols}, s.name.c_str());
    p.weights.push_back(weights[k].data());
  }
  return p;
}

block::Selection selection(const std::vector<bool>& wrt, size_t count) {
  if (wrt.size() != count)
    throw std::invalid_argument("block: wrt needs one flag per parameter (" + std::to_string(count) + ")");
  return wrt;
}

template <class T>
block::Target<T> target(const Problem<T>& p, int kind, const optional_carray<T>& values,
                        const optional_carray<std::int64_t>& classes, const optional_carray<T>& head_weight,
                        const optional_carray<T>& head_bias) {
  if (kind < 0 || kind > 2) throw std::invalid_argument("block: unknown loss kind");
  const bool pooled = kind == 2;
  if ((kind == 0) != static_cast<bool>(values) || (kind != 0) != static_cast<bool>(classes))
    throw std::invalid_argument("block: mse needs values, cross_entropy and pooled_cross_entropy need classes");
  if (pooled != (head_weight && head_bias))
    throw std::invalid_argument("block: pooled_cross_entropy, and only it, needs a head (W_C, b_C)");
  block::Target<T> t;
  t.kind = static_cast<loss::Kind>(kind);
  index_t classes_range = p.dims.d;
  if (pooled) {
    if (head_weight->ndim() != 2) throw std::invalid_argument("block: W_C must be 2-D (d, classes)");
    t.head.classes = static_cast<index_t>(head_weight->shape(1));
    require_shape(*head_weight, {p.dims.d, t.head.classes}, "W_C");
    require_shape(*head_bias, {t.head.classes}, "b_C");
    t.head.weight = head_weight->data();
    t.head.bias = head_bias->data();
    classes_range = t.head.classes;
  }
  if (values) require_shape(*values, {p.B, p.dims.L, p.dims.d}, "target");
  if (classes) {
    if (pooled) require_shape(*classes, {p.B}, "target");
    else require_shape(*classes, {p.B, p.dims.L}, "target");
    const std::int64_t* c = classes->data();
    for (index_t k = 0; k < static_cast<index_t>(classes->size()); ++k)
      if (c[k] < 0 || c[k] >= classes_range) throw std::invalid_argument("block: class index out of range");
  }
  t.values = data_or_null(values);
  t.classes = data_or_null(classes);
  return t;
}

// Everything a curvature call checks before it computes: the problem, the selection and its size
// P, the loss target and the part.
template <class T>
struct CurvatureCall {
  Problem<T> problem;
  block::Selection wrt;
  index_t P = 0;
  block::Target<T> target;
  block::Part part = block::Part::full;
};

template <class T>
CurvatureCall<T> curvature_call(const carray<T>& X, const SpecTuple& spec, const std::vector<carray<T>>& W, int kind,
                                const optional_carray<T>& values, const optional_carray<std::int64_t>& classes,
                                int part, const std::vector<bool>& wrt, const optional_carray<T>& head_weight,
                                const optional_carray<T>& head_bias) {
  CurvatureCall<T> c;
  c.problem = problem(X, spec, W);
  const auto shapes = c.problem.shapes();
  c.wrt = selection(wrt, shapes.size());
  std::vector<index_t> off;
  c.P = block::offsets(shapes, c.wrt, off);
  if (part < 0 || part > 2) throw std::invalid_argument("block: bad part");
  c.part = static_cast<block::Part>(part);
  c.target = target<T>(c.problem, kind, values, classes, head_weight, head_bias);
  return c;
}

template <class T>
void bind_for(py::module_& m) {
  using A = const carray<T>&;
  using Weights = const std::vector<carray<T>>&;
  using opt_classes = optional_carray<std::int64_t>;

  m.def(
      "block_forward",
      [](A X, const SpecTuple& spec, Weights W, T eps, carray<T>& out) {
        const auto p = problem(X, spec, W);
        require_shape(out, {p.B, p.dims.L, p.dims.d}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        const auto e = p.evaluate(X.data(), eps);
        std::copy_n(e.output(), p.B * p.dims.L * p.dims.d, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("out").noconvert());

  m.def(
      "block_jacobian",
      [](A X, const SpecTuple& spec, Weights W, T eps, int param, carray<T>& out) {
        const auto p = problem(X, spec, W);
        const auto shapes = p.shapes();
        if (p.B != 1) throw std::invalid_argument("block_jacobian: one sample only");
        if (param < 0 || param >= static_cast<int>(shapes.size())) throw std::invalid_argument("block_jacobian: bad param");
        require_shape(out, {p.dims.L * p.dims.d, shapes[param].size()}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = p.evaluate(X.data(), eps);
        block::jacobian(e, param, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("param"),
      py::arg("out").noconvert());

  m.def(
      "block_output_hessian",
      [](A X, const SpecTuple& spec, Weights W, T eps, int i, int j, carray<T>& out) {
        const auto p = problem(X, spec, W);
        const auto shapes = p.shapes();
        const int count = static_cast<int>(shapes.size());
        if (p.B != 1) throw std::invalid_argument("block_output_hessian: one sample only");
        if (i < 0 || i >= count || j < 0 || j >= count) throw std::invalid_argument("block_output_hessian: bad param");
        require_shape(out, {p.dims.L * p.dims.d * shapes[i].size(), shapes[j].size()}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = p.evaluate(X.data(), eps);
        block::output_hessian(e, i, j, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("i"), py::arg("j"),
      py::arg("out").noconvert());

  m.def(
      "loss_gradient",
      [](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, std::optional<carray<T>> out, const optional_carray<T>& head_weight,
         const optional_carray<T>& head_bias) {
        const auto p = problem(X, spec, W);
        T* o = nullptr;
        if (out) {
          index_t P = 0;
          for (const auto& s : p.shapes()) P += s.size();
          require_shape(*out, {P}, "out");
          o = mutable_ptr(*out);
        }
        const auto tgt = target<T>(p, kind, values, classes, head_weight, head_bias);
        py::gil_scoped_release release;
        auto e = p.evaluate(X.data(), eps);
        return block::loss_gradient(e, tgt, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
      py::arg("out").noconvert().none(true), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  // The dense loss Hessian (out: (P, P)) and its diagonal (out: (P,)), over the parameters in wrt.
  m.def(
      "loss_hessian",
      [](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, carray<T>& out,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        require_shape(out, {c.P, c.P}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = c.problem.evaluate(X.data(), eps);
        return block::loss_hessian(e, c.target, c.part, c.wrt, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out").noconvert(), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  m.def(
      "loss_hessian_diagonal",
      [](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, carray<T>& out,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        require_shape(out, {c.P}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = c.problem.evaluate(X.data(), eps);
        return block::loss_hessian_diagonal(e, c.target, c.part, c.wrt, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out").noconvert(), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  // One product H V (V of shape (P,) or (P, k)), the weights read in place: loss_hvp.
  m.def(
      "loss_hvp",
      [](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, A V, carray<T>& out,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        if (V.ndim() < 1 || V.ndim() > 2 || V.shape(0) != c.P) throw std::invalid_argument("loss_hvp: V must be (P,) or (P, k)");
        const index_t k = V.ndim() == 2 ? V.shape(1) : 1;
        if (V.ndim() == 2) require_shape(out, {c.P, k}, "out");
        else require_shape(out, {c.P}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        block::HessianOperator<T>(c.problem.evaluate(X.data(), eps), c.target, c.part, c.wrt).apply_columns(V.data(), k, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("V").noconvert(), py::arg("out").noconvert(),
      py::arg("head_weight").noconvert().none(true) = py::none(), py::arg("head_bias").noconvert().none(true) = py::none());

  // The loss Hessian as an operator: the forward and reverse passes are computed once, at
  // construction; apply(V, out) writes H V for V of shape (P,) or (P, k).
  using Operator = block::HessianOperator<T>;
  // module_local: every instruction-set build of the core (_core_portable, _core_x86_64_v3, ...)
  // binds this same C++ type.
  py::class_<Operator>(m, sizeof(T) == 8 ? "HessianOperator64" : "HessianOperator32", py::module_local())
      .def(py::init([](A X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
                       const opt_classes& classes, int part, const std::vector<bool>& wrt,
                       const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
             const auto p = problem(X, spec, W);
             const auto sel = selection(wrt, p.shapes().size());
             if (part < 0 || part > 2) throw std::invalid_argument("HessianOperator: bad part");
             const auto tgt = target<T>(p, kind, values, classes, head_weight, head_bias);
             py::gil_scoped_release release;
             return new Operator(p.evaluate_kept(X.data(), eps), tgt, static_cast<block::Part>(part), sel);
           }),
           py::arg("X").noconvert(), py::arg("spec"), py::arg("weights"), py::arg("eps"), py::arg("kind"), py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
           py::arg("part"), py::arg("wrt"), py::arg("head_weight").noconvert().none(true) = py::none(),
           py::arg("head_bias").noconvert().none(true) = py::none())
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
      [](const SpecTuple& spec, index_t d, index_t dk, index_t dv, index_t dff) {
        const block::Spec s = spec_of(spec);
        const block::Dims D{1, d, dk, dff, dv};
        block::check(s, D);
        py::list table;
        for (const auto& p : block::parameters(s, D))
          table.append(py::make_tuple(p.name, p.vector ? py::tuple(py::make_tuple(p.cols)) : py::tuple(py::make_tuple(p.rows, p.cols))));
        return table;
      },
      "The parameters of a block in the canonical order: [(name, shape)] (params.hpp).", py::arg("spec"),
      py::arg("d"), py::arg("d_k"), py::arg("d_v"), py::arg("d_ff"));
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });
}

}  // namespace blockhess::bind
