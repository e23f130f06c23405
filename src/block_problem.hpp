// What every block binding checks before it computes, shared by _core (bind_block.cpp) and _cuda
// (cuda_block.cpp): the spec, the sizes, the weights against the registry, the selection, the loss
// target and the part. X is (B, L, d); weights hold one array per parameter in the registry's
// canonical order (vectors 1-D). A language model (a spec with a vocabulary) reads token ids
// instead: X is (B, L) int64.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "blockhess/block_model.hpp"
#include "blockhess/registry.hpp"

namespace blockhess::bind {

// The spec as Python passes it (spec.py's BlockSpec._core, model.py's ModelSpec._core): (norm_position,
// norm, norm_affine, bias, heads, out_proj, activation, causal, attention_only, layers, final_norm,
// vocab, positions, lm_head, patch_dim, classes, class_token), the choices as their registries'
// codes; then the model (params.hpp's Stack): layers blocks of that spec stacked (1: the block
// itself), a final norm, a language model's vocabulary, learned positions and tied LM head, a ViT's
// patch width, a classifier's classes and a class token (0 and false: none).
using SpecTuple = std::tuple<int, int, bool, bool, index_t, bool, int, bool, bool, index_t, bool, index_t, index_t, bool,
                             index_t, index_t, bool>;

inline block::Spec spec_of(const SpecTuple& t) {
  block::Spec s;
  std::tie(std::ignore, std::ignore, s.norm_affine, s.bias, s.heads, s.out_proj, std::ignore, s.causal, s.attention_only,
           std::ignore, std::ignore, std::ignore, std::ignore, std::ignore, std::ignore, std::ignore, std::ignore) = t;
  s.norm_position = static_cast<block::NormPosition>(registry::checked(block::kNormPositions, std::get<0>(t), "norm_position"));
  s.norm = static_cast<block::Norm>(registry::checked(block::kNorms, std::get<1>(t), "norm"));
  s.activation = activation::from_code(std::get<6>(t));
  return s;
}

inline block::Stack stack_of(const SpecTuple& t) {
  const block::Stack stack{std::get<9>(t),  std::get<10>(t), std::get<11>(t), std::get<12>(t),
                           std::get<13>(t), std::get<14>(t), std::get<15>(t), std::get<16>(t)};
  if (stack.layers < 1) throw std::invalid_argument("block: layers must be >= 1, got " + std::to_string(stack.layers));
  return stack;
}

template <class T>
struct Problem {
  block::Spec spec;
  block::Dims dims;
  block::Stack stack;
  index_t B = 0;
  const T* X = nullptr;               // (B, L, d), or
  const std::int64_t* ids = nullptr;  // a language model's token ids (B, L), in the host's memory
  std::vector<const T*> weights;
  const Backend<T>* backend = &cpu_backend<T>();  // where the arrays live and the model runs

  // The model at its input, for one call: the input and weights are the caller's arrays, alive
  // until it returns.
  block::Model<T> evaluate(T eps) const { return make(eps, engine::Storage::borrow); }
  // For an object that outlives the call (the Hessian operator): a copy of the input and weights.
  block::Model<T> evaluate_kept(T eps) const { return make(eps, engine::Storage::copy); }
  std::vector<block::ParamShape> shapes() const { return block::parameters(spec, dims, stack); }
  // The width of the output: d, the LM head's vocabulary or the classifier's classes.
  index_t output_width() const { return stack.output_width(dims.d); }

 private:
  block::Model<T> make(T eps, engine::Storage storage) const {
    if (ids) return block::Model<T>::language_model(spec, dims, stack, B, ids, weights, eps, storage, *backend);
    return block::Model<T>::stack(spec, dims, stack, B, X, weights, eps, storage, *backend);
  }
};

// An array the Python layer validated: its shape and data, from a host array or a device array
// (which _cuda's bindings take as its pointer and shape).
template <class Data>
struct ArrayShape {
  std::vector<index_t> shape;
  const Data* data = nullptr;
};
template <class T>
ArrayShape<T> shape_of(const carray<T>& a) {
  return {std::vector<index_t>(a.shape(), a.shape() + a.ndim()), a.data()};
}
template <class T>
std::optional<ArrayShape<T>> shape_of(const optional_carray<T>& a) {
  return a ? std::optional<ArrayShape<T>>(shape_of(*a)) : std::nullopt;
}

// The sizes from X (or the token ids) and the weights (d from W_Q's rows, d_k from its columns, d_v
// from W_V, d_ff from W_1; 0 for an attention-only block, which has none), then every shape
// checked against the registry. X (B, L, d) of the weights' dtype, or a language model's ids (B, L).
template <class T>
Problem<T> problem_of(const std::vector<index_t>& X_shape, const T* X, const std::int64_t* ids, const SpecTuple& spec,
                      const std::vector<ArrayShape<T>>& weights) {
  Problem<T> p;
  p.spec = spec_of(spec);
  p.stack = stack_of(spec);
  p.X = X;
  p.ids = ids;
  if (X_shape.size() != (ids ? 2u : 3u))
    throw std::invalid_argument(ids ? "model: X must be token ids (B, L)" : "block: X must be (B, L, d)");
  p.B = X_shape[0];
  p.dims.L = X_shape[1];
  const auto names = block::parameters(p.spec, block::Dims{1, 1, 1, 1, 1}, p.stack);
  if (weights.size() != names.size())
    throw std::invalid_argument("block: " + std::to_string(names.size()) + " parameters expected, got " +
                                std::to_string(weights.size()));
  auto size_of = [&](const char* own_name, int axis) {  // the first layer's
    const std::string name = block::layer_prefix(p.stack.layers, 0) + own_name;
    for (size_t k = 0; k < names.size(); ++k)
      if (names[k].name == name) {
        if (weights[k].shape.size() != 2) throw std::invalid_argument("block: " + name + " must be 2-D");
        return weights[k].shape[static_cast<size_t>(axis)];
      }
    throw std::logic_error("block: no parameter named " + name);
  };
  auto cols_of = [&](const char* own_name) { return size_of(own_name, 1); };
  p.dims.d = p.ids || p.stack.reads_patches() ? size_of("W_Q", 0) : X_shape[2];
  if (p.stack.reads_patches() && X_shape[2] != p.stack.patch_dim)
    throw std::invalid_argument("model: X must be patches (B, L, " + std::to_string(p.stack.patch_dim) + ")");
  if (p.spec.heads < 1) throw std::invalid_argument("block: heads must be >= 1");
  p.dims.dk = cols_of("W_Q") / p.spec.heads;
  p.dims.dv = cols_of("W_V") / p.spec.heads;
  p.dims.dff = p.spec.attention_only ? 0 : cols_of("W_1");
  block::check(p.spec, p.dims);
  const auto shapes = p.shapes();
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto& s = shapes[k];
    const std::vector<index_t> expected = s.vector ? std::vector<index_t>{s.cols} : std::vector<index_t>{s.rows, s.cols};
    require_shape_of(weights[k].shape, expected, s.name.c_str());
    p.weights.push_back(weights[k].data);
  }
  return p;
}

// The same from host arrays: X C-contiguous of the weights' dtype, or a language model's int64 ids.
template <class T>
Problem<T> problem(const py::array& X, const SpecTuple& spec, const std::vector<carray<T>>& weights) {
  const bool ids = stack_of(spec).reads_tokens();
  if (ids && !py::isinstance<carray<std::int64_t>>(X)) throw py::type_error("model: X must be C-contiguous int64 token ids");
  if (!ids && !py::isinstance<carray<T>>(X)) throw py::type_error("block: X must be C-contiguous, of the weights' dtype");
  std::vector<ArrayShape<T>> shapes;
  for (const carray<T>& w : weights) shapes.push_back(shape_of(w));
  return problem_of<T>(std::vector<index_t>(X.shape(), X.shape() + X.ndim()), ids ? nullptr : static_cast<const T*>(X.data()),
                       ids ? static_cast<const std::int64_t*>(X.data()) : nullptr, spec, shapes);
}

// block_output_hessian's problem: one sample, and i, j naming parameters of the spec.
template <class T>
Problem<T> output_hessian_problem(const py::array& X, const SpecTuple& spec, const std::vector<carray<T>>& weights,
                                  int i, int j) {
  Problem<T> p = problem(X, spec, weights);
  const int count = static_cast<int>(p.shapes().size());
  if (p.B != 1) throw std::invalid_argument("block_output_hessian: one sample only");
  if (i < 0 || i >= count || j < 0 || j >= count) throw std::invalid_argument("block_output_hessian: bad param");
  return p;
}

inline block::Selection selection(const std::vector<bool>& wrt, size_t count) {
  if (wrt.size() != count)
    throw std::invalid_argument("block: wrt needs one flag per parameter (" + std::to_string(count) + ")");
  return wrt;
}

// The loss's target from arrays the caller holds (host or device; their shapes checked, their
// entries not read): mse's values, a cross-entropy's classes, a pooled head's (W_C, b_C).
template <class T>
block::Target<T> target_of(const Problem<T>& p, int kind, const std::optional<ArrayShape<T>>& values,
                           const std::optional<ArrayShape<std::int64_t>>& classes,
                           const std::optional<ArrayShape<T>>& head_weight, const std::optional<ArrayShape<T>>& head_bias) {
  registry::checked(heads::kNames, kind, "loss");
  const bool pooled = kind == heads::kPooledCrossEntropy;
  if ((kind == 0) != static_cast<bool>(values) || (kind != 0) != static_cast<bool>(classes))
    throw std::invalid_argument("block: mse needs values, cross_entropy and pooled_cross_entropy need classes");
  const bool own_classifier = p.stack.classes > 0;  // the model's W_C, b_C: its output is the logits
  if ((pooled && !own_classifier) != (head_weight && head_bias))
    throw std::invalid_argument(own_classifier ? "block: the model has its own classifier (W_C, b_C): no head"
                                               : "block: pooled_cross_entropy, and only it, needs a head (W_C, b_C)");
  block::Target<T> t;
  t.loss = kind;
  if (kind == heads::kNextToken && !p.stack.lm_head)
    throw std::invalid_argument("block: next_token is the loss of a language model's logits (an LM head)");
  if (pooled && own_classifier) {
    t.classifier.classes = p.stack.classes;  // W_C, b_C null: the logits are the output's rows
    t.classifier.first_token = p.stack.class_token;
  } else if (pooled) {
    if (head_weight->shape.size() != 2) throw std::invalid_argument("block: W_C must be 2-D (d, classes)");
    t.classifier.classes = head_weight->shape[1];
    require_shape_of(head_weight->shape, {p.dims.d, t.classifier.classes}, "W_C");
    require_shape_of(head_bias->shape, {t.classifier.classes}, "b_C");
    t.classifier.weight = head_weight->data;
    t.classifier.bias = head_bias->data;
  }
  if (values) require_shape_of(values->shape, {p.B, p.dims.L, p.output_width()}, "target");
  if (classes) require_shape_of(classes->shape, pooled ? std::vector<index_t>{p.B} : std::vector<index_t>{p.B, p.dims.L},
                                "target");
  t.values = values ? values->data : nullptr;
  t.classes = classes ? classes->data : nullptr;
  return t;
}

// The same from host arrays, whose classes are checked in range here.
template <class T>
block::Target<T> target(const Problem<T>& p, int kind, const optional_carray<T>& values,
                        const optional_carray<std::int64_t>& classes, const optional_carray<T>& head_weight,
                        const optional_carray<T>& head_bias) {
  const block::Target<T> t =
      target_of<T>(p, kind, shape_of(values), shape_of(classes), shape_of(head_weight), shape_of(head_bias));
  if (classes) {
    const index_t range = t.classifier.weight ? t.classifier.classes : p.output_width();
    const std::int64_t* c = classes->data();
    for (index_t k = 0; k < static_cast<index_t>(classes->size()); ++k)
      if ((c[k] < 0 || c[k] >= range) && !(kind == heads::kNextToken && c[k] == engine::kIgnoredClass))
        throw std::invalid_argument("block: class index out of range");
  }
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

// The call on a problem: its selection, their size P and the part (the target left to the caller).
template <class T>
CurvatureCall<T> curvature_call_of(Problem<T> problem, const std::vector<bool>& wrt, int part) {
  CurvatureCall<T> c;
  c.problem = std::move(problem);
  const auto shapes = c.problem.shapes();
  c.wrt = selection(wrt, shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k)
    if (c.wrt[k]) c.P += shapes[k].size();
  if (part < 0 || part > 2) throw std::invalid_argument("block: bad part");
  c.part = static_cast<block::Part>(part);
  return c;
}

template <class T>
CurvatureCall<T> curvature_call(const py::array& X, const SpecTuple& spec, const std::vector<carray<T>>& W, int kind,
                                const optional_carray<T>& values, const optional_carray<std::int64_t>& classes,
                                int part, const std::vector<bool>& wrt, const optional_carray<T>& head_weight,
                                const optional_carray<T>& head_bias) {
  CurvatureCall<T> c = curvature_call_of(problem(X, spec, W), wrt, part);
  c.target = target<T>(c.problem, kind, values, classes, head_weight, head_bias);
  return c;
}

}  // namespace blockhess::bind
