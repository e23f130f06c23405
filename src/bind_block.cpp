// Bindings for the Transformer block family: forward, Jacobians, output second derivatives, and the
// loss gradient, Hessian and Hessian operator. X is (B, L, d) (B = 1 for the single-sample
// functions); spec is the block (params.hpp's Spec as a tuple); weights holds one array per
// parameter, in the registry's canonical order (vectors 1-D).
#include "binding.hpp"
#include "block_problem.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "blockhess/block_model.hpp"

namespace blockhess::bind {
namespace {

template <class T>
void bind_for(py::module_& m) {
  using A = const carray<T>&;
  using Input = const py::array&;  // X (B, L, d) of T, or a language model's int64 token ids (B, L)
  using Weights = const std::vector<carray<T>>&;
  using opt_classes = optional_carray<std::int64_t>;

  m.def(
      "block_forward",
      [](Input X, const SpecTuple& spec, Weights W, T eps, carray<T>& out) {
        const auto p = problem(X, spec, W);
        require_shape(out, {p.B, p.dims.L, p.output_width()}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        const auto e = p.evaluate(eps);
        std::copy_n(e.output(), p.B * p.dims.L * p.output_width(), o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("out").noconvert());

  m.def(
      "block_jacobian",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int param, carray<T>& out) {
        const auto p = problem(X, spec, W);
        const auto shapes = p.shapes();
        if (p.B != 1) throw std::invalid_argument("block_jacobian: one sample only");
        if (param < 0 || param >= static_cast<int>(shapes.size())) throw std::invalid_argument("block_jacobian: bad param");
        require_shape(out, {p.dims.L * p.output_width(), shapes[param].size()}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = p.evaluate(eps);
        e.jacobian(param, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("param"),
      py::arg("out").noconvert());

  m.def(
      "block_output_hessian",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int i, int j, carray<T>& out) {
        const auto p = output_hessian_problem(X, spec, W, i, j);
        const auto shapes = p.shapes();
        require_shape(out, {p.dims.L * p.output_width() * shapes[i].size(), shapes[j].size()}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = p.evaluate(eps);
        e.output_hessian(i, j, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("i"), py::arg("j"),
      py::arg("out").noconvert());

  m.def(
      "loss_gradient",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
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
        auto e = p.evaluate(eps);
        return e.loss_gradient(tgt, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
      py::arg("out").noconvert().none(true), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  // The dense loss Hessian (out: (P, P)) and its diagonal (out: (P,)), over the parameters in wrt.
  m.def(
      "loss_hessian",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, carray<T>& out,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        require_shape(out, {c.P, c.P}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = c.problem.evaluate(eps);
        return e.loss_hessian(c.target, c.part, c.wrt, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out").noconvert(), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  m.def(
      "loss_hessian_diagonal",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, carray<T>& out, index_t max_products,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        require_shape(out, {c.P}, "out");
        if (max_products < 0) throw std::invalid_argument("max_products must be >= 0");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        auto e = c.problem.evaluate(eps);
        return e.loss_hessian_diagonal(c.target, c.part, c.wrt, o, max_products);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("out").noconvert(), py::arg("max_products"),
      py::arg("head_weight").noconvert().none(true) = py::none(), py::arg("head_bias").noconvert().none(true) = py::none());

  // K-FAC's factors of the selected weights applied to every token: a list of (parameter index,
  // A, G), K-FAC-expand or (reduce) K-FAC-reduce (engine/kfac.hpp).
  m.def(
      "kfac_factors",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, const std::vector<bool>& wrt, bool reduce, const optional_carray<T>& head_weight,
         const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, 0, wrt, head_weight, head_bias);
        std::vector<engine::KroneckerFactors<T>> factors;
        {
          py::gil_scoped_release release;
          auto e = c.problem.evaluate(eps);
          factors = e.kfac_factors(c.target, c.wrt, reduce);
        }
        py::list out;
        for (const auto& f : factors) {
          py::array_t<T> A({f.rows, f.rows}), G({f.cols, f.cols});
          std::copy(f.A.begin(), f.A.end(), A.mutable_data());
          std::copy(f.G.begin(), f.G.end(), G.mutable_data());
          out.append(py::make_tuple(f.param, A, G));
        }
        return out;
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("wrt"),
      py::arg("reduce"), py::arg("head_weight").noconvert().none(true) = py::none(),
      py::arg("head_bias").noconvert().none(true) = py::none());

  // One product H V (V of shape (P,) or (P, k)), the weights read in place: loss_hvp.
  m.def(
      "loss_hvp",
      [](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
         const opt_classes& classes, int part, const std::vector<bool>& wrt, A V, carray<T>& out,
         const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
        const auto c = curvature_call<T>(X, spec, W, kind, values, classes, part, wrt, head_weight, head_bias);
        if (V.ndim() < 1 || V.ndim() > 2 || V.shape(0) != c.P) throw std::invalid_argument("loss_hvp: V must be (P,) or (P, k)");
        const index_t k = V.ndim() == 2 ? V.shape(1) : 1;
        if (V.ndim() == 2) require_shape(out, {c.P, k}, "out");
        else require_shape(out, {c.P}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        block::LossHessianOperator<T>(c.problem.evaluate(eps), c.target, c.part, c.wrt).apply_columns(V.data(), k, o);
      },
      py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"),
      py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true), py::arg("part"),
      py::arg("wrt"), py::arg("V").noconvert(), py::arg("out").noconvert(),
      py::arg("head_weight").noconvert().none(true) = py::none(), py::arg("head_bias").noconvert().none(true) = py::none());

  // The loss Hessian as an operator: the forward and reverse passes are computed once, at
  // construction; apply(V, out) writes H V for V of shape (P,) or (P, k).
  using Operator = block::LossHessianOperator<T>;
  // module_local: every instruction-set build of the core (_core_portable, _core_x86_64_v3, ...)
  // binds this same C++ type.
  py::class_<Operator>(m, sizeof(T) == 8 ? "HessianOperator64" : "HessianOperator32", py::module_local())
      .def(py::init([](Input X, const SpecTuple& spec, Weights W, T eps, int kind, const optional_carray<T>& values,
                       const opt_classes& classes, int part, const std::vector<bool>& wrt,
                       const optional_carray<T>& head_weight, const optional_carray<T>& head_bias) {
             const auto p = problem(X, spec, W);
             const auto sel = selection(wrt, p.shapes().size());
             if (part < 0 || part > 2) throw std::invalid_argument("HessianOperator: bad part");
             const auto tgt = target<T>(p, kind, values, classes, head_weight, head_bias);
             py::gil_scoped_release release;
             return new Operator(p.evaluate_kept(eps), tgt, static_cast<block::Part>(part), sel);
           }),
           py::arg("X").noconvert(), py::arg("spec"), py::arg("weights").noconvert(), py::arg("eps"), py::arg("kind"), py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
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
        for (const auto& p : block::parameters(s, D, stack_of(spec)))
          table.append(py::make_tuple(p.name, p.vector ? py::tuple(py::make_tuple(p.cols)) : py::tuple(py::make_tuple(p.rows, p.cols))));
        return table;
      },
      "The parameters of a block (or a stack) in the canonical order: [(name, shape)] (params.hpp).", py::arg("spec"),
      py::arg("d"), py::arg("d_k"), py::arg("d_v"), py::arg("d_ff"));
  m.def(
      "working_memory",
      [](const SpecTuple& spec, index_t B, index_t L, index_t d, index_t dk, index_t dv, index_t dff, int call, int loss,
         index_t head_classes, int part, const std::vector<bool>& wrt, index_t columns, index_t threads,
         index_t itemsize) {
        if (call < 0 || call > static_cast<int>(engine::Call::output_hessian))
          throw std::invalid_argument("working_memory: bad call");
        if (part < 0 || part > 2) throw std::invalid_argument("working_memory: bad part");
        const block::Spec s = spec_of(spec);
        const block::Dims D{L, d, dk, dff, dv};
        block::check(s, D);
        block::Target<double> target;
        if (loss >= 0) {
          registry::checked(heads::kNames, loss, "loss");
          target.loss = loss;
          const block::Stack stack = stack_of(spec);
          target.classifier.classes = stack.classes > 0 ? stack.classes : head_classes;
          target.classifier.first_token = stack.classes > 0 && stack.class_token;
        }
        const index_t elements = block::Model<double>::working_memory(
            s, D, stack_of(spec), B, loss >= 0 ? &target : nullptr, static_cast<engine::Call>(call),
            static_cast<block::Part>(part), wrt, columns, threads);
        return elements * itemsize;
      },
      "The bytes a call would allocate besides its result, estimated by the core from the model's wiring "
      "(engine/working_memory.hpp); nothing is computed. call: engine::Call's code; loss: a loss code, or -1 "
      "for the calls without one; head_classes: a pooled head's classes (its W_C's columns), else 0.",
      py::arg("spec"), py::arg("B"), py::arg("L"), py::arg("d"), py::arg("d_k"), py::arg("d_v"), py::arg("d_ff"),
      py::arg("call"), py::arg("loss"), py::arg("head_classes"), py::arg("part"), py::arg("wrt"), py::arg("columns"),
      py::arg("threads"), py::arg("itemsize"));
  m.def("layer_prefix", &block::layer_prefix,
        "The name prefix of layer l of a stack of `layers` blocks: \"h.<l>.\", or none for a lone block (params.hpp).",
        py::arg("layers"), py::arg("l"));
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });
}

}  // namespace blockhess::bind
