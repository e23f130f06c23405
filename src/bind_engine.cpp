// The curvature engine's nodes, one at a time (private: the per-node tests drive it). A chain of
// nodes is wired from names, run on X, and differentiated for the scalar l = <G, out>: its
// gradient, the dense Hessian of the selected parameters (the nodes' curvature, since l is linear
// in out) and the Hessian-vector product for the columns of V. engine_head puts a loss head
// (heads.hpp) at the chain's output instead: the loss, its gradient, Hessian and products.
//   "linear"            out = cur W (takes the next parameter)
//   "linear_bias"       out = cur W + b (takes two: W, then b of shape (1, w_out))
//   "relu", "gelu", "gelu_tanh", "silu"   out = phi(cur) (activation.hpp)
//   "layernorm"         out = LN(cur) (eps)
//   "layernorm_affine"  out = gamma * LN(cur) + beta (takes two, each (1, width))
//   "rmsnorm"           out = RMSNorm(cur) (eps); "rmsnorm_affine": gamma * RMSNorm(cur) (takes gamma)
//   "residual"          out = cur + (the input of the node that produced cur): a skip around it
//   "attention"         out = attention(cur; W_Q, W_K, W_V) (takes three; cur must be X)
//   "attention_causal"  the same with keys after the query masked
//   "attention_bias"    with biases: takes W_Q, b_Q, W_K, b_K, W_V, b_V (biases (1, width))
//   "attention_2heads"  two heads (W_Q, W_K, W_V each split into two blocks of columns), with biases
#include "binding.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/loss.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/nodes/attention.hpp"
#include "blockhess/engine/nodes/layernorm.hpp"
#include "blockhess/engine/nodes/linear.hpp"
#include "blockhess/engine/nodes/pointwise.hpp"
#include "blockhess/engine/nodes/residual.hpp"
#include "blockhess/heads.hpp"

namespace blockhess::bind {
namespace {

// The chain of `kinds` on a graph of X's batch: its parameters in order, its output set.
template <class T>
std::unique_ptr<engine::Graph<T>> wire_chain(const std::vector<std::string>& kinds, const carray<T>& X,
                                             const std::vector<carray<T>>& params, T eps, const std::vector<bool>& wrt) {
  using namespace engine;
  if (X.ndim() != 3) throw std::invalid_argument("engine_chain: X must be (B, L, d)");
  if (wrt.size() != params.size()) throw std::invalid_argument("engine_chain: one wrt flag per parameter");
  auto graph = std::make_unique<Graph<T>>(X.shape(0), X.shape(1));
  Graph<T>& g = *graph;
  std::vector<int> param_ids;
  for (size_t k = 0; k < params.size(); ++k) {
    if (params[k].ndim() != 2) throw std::invalid_argument("engine_chain: parameters must be 2-D");
    param_ids.push_back(g.param("p" + std::to_string(k), params[k].shape(0), params[k].shape(1), params[k].data()));
  }
  int cur = g.input(X.data(), X.shape(2)), before = -1;
  size_t next = 0;
  auto take = [&]() {
    if (next >= param_ids.size()) throw std::invalid_argument("engine_chain: too few parameters for the chain");
    return param_ids[next++];
  };
  for (const std::string& kind : kinds) {
    const int in = cur;
    if (kind == "linear" || kind == "linear_bias") {
      std::vector<int> owned{take()};
      if (kind == "linear_bias") owned.push_back(take());
      const index_t w_out = g.parameter(owned[0]).cols;
      if (g.parameter(owned[0]).rows != g.width(cur)) throw std::invalid_argument("engine_chain: linear weight rows != width");
      if (owned.size() == 2 && (g.parameter(owned[1]).rows != 1 || g.parameter(owned[1]).cols != w_out))
        throw std::invalid_argument("engine_chain: a bias must be (1, w_out)");
      cur = g.add(std::make_unique<LinearNode<T>>("engine_chain: linear"), {cur}, owned, w_out);
    } else if (kind == "relu" || kind == "gelu" || kind == "gelu_tanh" || kind == "silu") {
      cur = g.add(std::make_unique<PointwiseNode<T>>(activation::parse(kind)), {cur}, {}, g.width(cur));
    } else if (kind == "layernorm") {
      cur = g.add(std::make_unique<LayerNormNode<T>>(eps), {cur}, {}, g.width(cur));
    } else if (kind == "rmsnorm" || kind == "rmsnorm_affine") {
      std::vector<int> owned;
      if (kind == "rmsnorm_affine") owned.push_back(take());
      for (int p : owned)
        if (g.parameter(p).rows != 1 || g.parameter(p).cols != g.width(cur))
          throw std::invalid_argument("engine_chain: gamma must be (1, width)");
      cur = g.add(std::make_unique<RmsNormNode<T>>(eps), {cur}, owned, g.width(cur));
    } else if (kind == "layernorm_affine") {
      const int gamma = take(), beta = take();
      for (int p : {gamma, beta})
        if (g.parameter(p).rows != 1 || g.parameter(p).cols != g.width(cur))
          throw std::invalid_argument("engine_chain: gamma and beta must be (1, width)");
      cur = g.add(std::make_unique<LayerNormNode<T>>(eps), {cur}, {gamma, beta}, g.width(cur));
    } else if (kind == "residual") {
      if (before < 0 || g.width(before) != g.width(cur)) throw std::invalid_argument("engine_chain: residual needs a same-width skip");
      cur = g.add(std::make_unique<ResidualNode<T>>("engine_chain: residual"), {cur, before}, {}, g.width(cur));
    } else if (kind == "attention" || kind == "attention_causal" || kind == "attention_bias" || kind == "attention_2heads") {
      std::vector<int> owned;
      const bool biased = kind == "attention_bias" || kind == "attention_2heads";
      for (int k = 0; k < (biased ? 6 : 3); ++k) owned.push_back(take());
      const index_t w_out = g.parameter(owned.back()).cols;
      cur = g.add(std::make_unique<AttentionNode<T>>(kind == "attention_causal", kind == "attention_2heads" ? 2 : 1), {cur},
                  owned, w_out);
    } else {
      throw std::invalid_argument("engine_chain: unknown node '" + kind + "'");
    }
    before = in;
  }
  if (next != param_ids.size()) throw std::invalid_argument("engine_chain: more parameters than the chain takes");
  g.set_output(cur);
  return graph;
}

// The columns of V (P_selected, k) checked against the selection.
template <class T>
index_t columns_of(const engine::Graph<T>& g, const std::vector<bool>& wrt, const carray<T>& V, index_t* P) {
  g.offsets(wrt, P);
  if (V.ndim() != 2 || V.shape(0) != *P) throw std::invalid_argument("engine_chain: V must be (P_selected, k)");
  return V.shape(1);
}

template <class T>
py::tuple engine_chain(const std::vector<std::string>& kinds, const carray<T>& X, const std::vector<carray<T>>& params,
                       T eps, const carray<T>& G, const std::vector<bool>& wrt, const carray<T>& V) {
  using namespace engine;
  auto graph = wire_chain(kinds, X, params, eps, wrt);
  Graph<T>& g = *graph;
  const index_t B = g.samples(), L = g.tokens_per_sample(), w = g.width(g.output()), n_out = B * L * w;
  require_shape(G, {B, L, w}, "G");
  index_t P_all = 0, P = 0;
  g.offsets(std::vector<bool>(wrt.size(), true), &P_all);
  const std::vector<index_t> offset = g.offsets(wrt);
  const index_t columns = columns_of(g, wrt, V, &P);
  py::array_t<T> out({B, L, w}), grad(P_all), H({P, P}), HV({P, columns});
  {
    py::gil_scoped_release release;
    g.forward();
    std::copy_n(g.value(g.output()), n_out, out.mutable_data());
    std::vector<T*> gradient;
    for (int k = 0, o = 0; k < g.num_params(); o += static_cast<int>(g.parameter(k).size()), ++k)
      gradient.push_back(grad.mutable_data() + o);
    g.reverse(G.data(), gradient);
    g.select(wrt);
    g.push_factors(/*to_output=*/false);
    assemble(g, g.curvature(), offset, P, H.mutable_data());
    Tangent<T> tangent;
    Buffer<T> column(P), product(P);
    auto no_seed = [](const T*, T*) { return false; };  // l is linear in out: no outer part
    for (index_t c = 0; c < columns; ++c) {
      for (index_t i = 0; i < P; ++i) column[i] = V.data()[i * columns + c];
      std::fill(product.begin(), product.end(), T(0));
      g.hvp(tangent, offset, column.data(), no_seed, /*curved=*/true, product.data());
      for (index_t i = 0; i < P; ++i) HV.mutable_data()[i * columns + c] = product[i];
    }
  }
  return py::make_tuple(out, grad, H, HV);
}

// The chain with a loss head at its output (heads.hpp: loss is a code of the registry, with its
// target): the loss, its gradient, the dense loss Hessian of the selected parameters (the head's
// curvature and the nodes') and the Hessian-vector product for the columns of V.
template <class T>
py::tuple engine_head(const std::vector<std::string>& kinds, const carray<T>& X, const std::vector<carray<T>>& params,
                      T eps, int loss, const optional_carray<T>& values, const optional_carray<std::int64_t>& classes,
                      const optional_carray<T>& classifier_weight, const optional_carray<T>& classifier_bias,
                      const std::vector<bool>& wrt, const carray<T>& V) {
  heads::Target<T> target;
  target.loss = loss;
  target.values = data_or_null(values);
  target.classes = data_or_null(classes);
  auto graph = wire_chain(kinds, X, params, eps, wrt);
  if (classifier_weight && classifier_bias) {
    target.classifier = {classifier_weight->data(), classifier_bias->data(), static_cast<index_t>(classifier_bias->size())};
    require_shape(*classifier_weight, {graph->width(graph->output()), target.classifier.classes}, "W_C");
  }
  index_t P_all = 0, P = 0;
  graph->offsets(std::vector<bool>(wrt.size(), true), &P_all);
  const index_t columns = columns_of(*graph, wrt, V, &P);
  py::array_t<T> grad(P_all), H({P, P}), HV({P, columns});
  T value = 0;
  {
    py::gil_scoped_release release;
    graph->forward();
    engine::reverse_loss(*graph, *heads::make(target), grad.mutable_data());
    engine::loss_hessian(*graph, *heads::make(target), engine::Part::full, wrt, H.mutable_data());
    const engine::LossOperator<T> op(std::move(graph), heads::make(target), engine::Part::full, wrt);
    value = op.loss_value();
    op.apply_columns(V.data(), columns, HV.mutable_data());
  }
  return py::make_tuple(value, grad, H, HV);
}

}  // namespace

void bind_engine(py::module_& m) {
  for_each_float([&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    m.def("engine_chain", &engine_chain<T>, "A chain of engine nodes and its derivatives for l = <G, out> (tests).",
          py::arg("kinds"), py::arg("X").noconvert(), py::arg("params"), py::arg("eps"), py::arg("G").noconvert(),
          py::arg("wrt"), py::arg("V").noconvert());
    m.def("engine_head", &engine_head<T>, "A chain of engine nodes with a loss head at its output (tests).",
          py::arg("kinds"), py::arg("X").noconvert(), py::arg("params"), py::arg("eps"), py::arg("loss"),
          py::arg("values").noconvert().none(true), py::arg("classes").noconvert().none(true),
          py::arg("classifier_weight").noconvert().none(true), py::arg("classifier_bias").noconvert().none(true),
          py::arg("wrt"), py::arg("V").noconvert());
  });
}

}  // namespace blockhess::bind
