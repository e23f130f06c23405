// The definitions behind components.hpp: each sublayer wired as a graph of the engine's nodes, and
// each result read from the engine's derivatives of that graph (engine/derivatives.hpp).
#pragma once

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "blockhess/activation.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/components.hpp"
#include "blockhess/eigen.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/nodes/attention.hpp"
#include "blockhess/engine/nodes/linear.hpp"
#include "blockhess/engine/nodes/pointwise.hpp"
#include "blockhess/engine/working_memory.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::components {
namespace detail {

// A sublayer's graph after its forward pass on `backend`, whose memory holds the arrays (or, with
// no input values, wired for its shapes only: engine/working_memory.hpp): its input value, (FFN)
// its hidden units relu(Y W_1), (attention) its node. The parameters are the graph's 0, 1 (and 2),
// in the order of the function's arguments.
template <class T>
struct Wired {
  Wired(const T* input_values, index_t L, index_t width, const Backend<T>& backend)
      : graph(std::make_unique<engine::Graph<T>>(1, L, backend)), input(graph->input(input_values, width)) {}
  std::unique_ptr<engine::Graph<T>> graph;
  int input = -1, hidden = -1;
  const engine::AttentionNode<T>* attention = nullptr;
};

// Runs `compute`, reporting an overflow inside the engine as one of `what`: the nodes name their
// stage as the block's ("block: the queries X W_Q"), which here is a stage of `what`.
template <class Fn>
void named(const std::string& what, Fn&& compute) {
  try {
    compute();
  } catch (const non_finite_error& e) {
    std::string stage = e.what();
    const std::string block = "block: ";
    if (stage.compare(0, block.size(), block) == 0) stage.erase(0, block.size());
    throw non_finite_error(what + ": " + stage);
  }
}

// An invalid_argument naming every size unless all are >= 1.
inline void require_sizes(const char* what, std::initializer_list<std::pair<const char*, index_t>> sizes) {
  std::string names, got;
  bool ok = true;
  for (const auto& [name, n] : sizes) {
    ok = ok && n >= 1;
    names += std::string(names.empty() ? "" : ", ") + name;
    got += std::string(got.empty() ? "" : ", ") + name + "=" + std::to_string(n);
  }
  if (!ok) throw std::invalid_argument(std::string(what) + ": need " + names + " >= 1, got " + got);
}

template <class T>
Wired<T> attention(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s,
                   const Backend<T>& backend = cpu_backend<T>()) {
  require_sizes("attention", {{"L", s.L}, {"d", s.d}, {"d_k", s.dk}, {"d_v", s.dv}});
  Wired<T> w(X, s.L, s.d, backend);
  engine::Graph<T>& g = *w.graph;
  const int wq = g.param("W_Q", s.d, s.dk, W_Q, engine::Storage::borrow);
  const int wk = g.param("W_K", s.d, s.dk, W_K, engine::Storage::borrow);
  const int wv = g.param("W_V", s.d, s.dv, W_V, engine::Storage::borrow);
  auto node = std::make_unique<engine::AttentionNode<T>>();
  w.attention = node.get();
  g.set_output(g.add(std::move(node), {w.input}, {wq, wk, wv}, s.dv));
  if (X) g.forward();
  return w;
}

constexpr int kW1 = 0, kW2 = 1;  // the FFN graph's parameters

template <class T>
Wired<T> ffn(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, const Backend<T>& backend = cpu_backend<T>()) {
  require_sizes("ffn", {{"L", s.L}, {"d", s.d}, {"d_ff", s.f}, {"d_out", s.e}});
  Wired<T> w(Y, s.L, s.d, backend);
  engine::Graph<T>& g = *w.graph;
  const int w1 = g.param("W_1", s.d, s.f, W_1, engine::Storage::borrow);
  const int w2 = g.param("W_2", s.f, s.e, W_2, engine::Storage::borrow);
  const int H = g.add(std::make_unique<engine::LinearNode<T>>("the FFN pre-activations Y W_1"), {w.input}, {w1}, s.f);
  w.hidden = g.add(std::make_unique<engine::PointwiseNode<T>>(activation::Kind::relu), {H}, {}, s.f);
  g.set_output(g.add(std::make_unique<engine::LinearNode<T>>("the FFN output relu(Y W_1) W_2"), {w.hidden}, {w2}, s.e));
  if (Y) g.forward();
  return w;
}

// The diagonal blocks of dF/dY of the FFN, (L, e, d), on the graph's backend. The FFN acts on each
// token alone, so one tangent that moves feature b of every token at once gives column b of every
// token's block: d tangents, not L d.
template <class T>
void ffn_input_blocks(const Wired<T>& w, const FfnDims& s, T* blocks, FiniteRecord& finite) {
  const index_t L = s.L, d = s.d, e = s.e;
  const Backend<T>& backend = w.graph->backend();
  engine::input_tangents(
      *w.graph, w.input, d, L * s.f * (d + e),
      [&](index_t b, T* dY) { backend.run(engine::rows::UnitColumn<T>{dY, d, b}, L * d); },
      [&](index_t b, const T* dF) {  // the input always reaches the output
        backend.run(engine::rows::WriteStrided<T>{dF, blocks + b, d}, L * e);
        finite.note(backend.all_finite(dF, L * e));
      });
}

// The engine's working-memory estimate of `call` on a sublayer's graph with parameter `p` (if any)
// selected.
template <class T>
index_t estimate(const Wired<T>& w, engine::Call call, int p, index_t columns, index_t threads) {
  std::vector<bool> selected(static_cast<size_t>(w.graph->num_params()), false);
  if (p >= 0) selected[static_cast<size_t>(p)] = true;
  return engine::WorkingMemory<T>(*w.graph, nullptr, selected, threads).of(call, engine::Part::functional, columns);
}

}  // namespace detail

template <class T>
index_t attention_working_memory(const AttentionDims& s, std::optional<AttentionWrt> wrt, index_t threads) {
  const auto w = detail::attention<T>(nullptr, nullptr, nullptr, nullptr, s);
  if (!wrt) return detail::estimate(w, engine::Call::forward, -1, 1, threads);
  if (*wrt == AttentionWrt::X)  // the node's closed form (input_jacobian)
    return detail::estimate(w, engine::Call::forward, -1, 1, threads) + w.attention->input_jacobian_footprint(*w.graph);
  return detail::estimate(w, engine::Call::jacobian, static_cast<int>(*wrt), 1, threads);
}

template <class T>
index_t ffn_working_memory(const FfnDims& s, std::optional<FfnJacobian> kind, index_t threads) {
  const auto w = detail::ffn<T>(nullptr, nullptr, nullptr, s);
  if (!kind || *kind == FfnJacobian::W_2_factor) return detail::estimate(w, engine::Call::forward, -1, 1, threads);
  switch (*kind) {
    case FfnJacobian::Y:  // and the diagonal blocks it spreads out (ffn_input_blocks)
      return detail::estimate(w, engine::Call::input_tangents, -1, s.d, threads) + s.L * s.e * s.d;
    case FfnJacobian::Y_blocks:
      return detail::estimate(w, engine::Call::input_tangents, -1, s.d, threads);
    case FfnJacobian::W_2:
      return detail::estimate(w, engine::Call::jacobian, detail::kW2, 1, threads);
    default:  // W_1 and its factors: W_1's tangent factors pushed to the output
      return detail::estimate(w, engine::Call::jacobian, detail::kW1, 1, threads);
  }
}

template <class T>
index_t ffn_cross_working_memory(const FfnDims& s, FfnCross kind, index_t threads) {
  const auto w = detail::ffn<T>(nullptr, nullptr, nullptr, s);
  // W_1's factors, a relu' mask per thread, and for the dense layout the values it spreads out.
  return detail::estimate(w, engine::Call::jacobian, detail::kW1, 1, threads) + threads * s.f +
         (kind == FfnCross::dense ? s.L * s.d * s.f : 0);
}

template <class T>
void attention_forward(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s, T* F,
                       const Backend<T>& backend) {
  detail::named("the attention output", [&] {
    const auto w = detail::attention(X, W_Q, W_K, W_V, s, backend);
    w.graph->copy(w.graph->value(w.graph->output()), F, s.L * s.dv);
  });
}

template <class T>
void attention_jacobian(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s,
                        AttentionWrt wrt, T* J, const Backend<T>& backend) {
  static const char* const name[] = {"W_Q", "W_K", "W_V", "X"};
  const std::string what = std::string("the attention Jacobian with respect to ") + name[static_cast<int>(wrt)];
  FiniteRecord finite;  // every entry checked as it is written
  detail::named(what, [&] {
    auto w = detail::attention(X, W_Q, W_K, W_V, s, backend);
    if (wrt == AttentionWrt::X) w.attention->input_jacobian(*w.graph, 0, J, &finite);  // its closed form
    else engine::jacobian(*w.graph, static_cast<int>(wrt), J, &finite);  // the graph's parameter wrt
  });
  finite.require<T>(what);
}

template <class T>
void ffn_forward(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, T* F, const Backend<T>& backend) {
  detail::named("the FFN output", [&] {
    const auto w = detail::ffn(Y, W_1, W_2, s, backend);
    w.graph->copy(w.graph->value(w.graph->output()), F, s.L * s.e);
  });
}

template <class T>
void ffn_jacobian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnJacobian kind, T* out,
                  const Backend<T>& backend) {
  static const char* const name[] = {"the FFN Jacobian with respect to W_1",
                                     "the FFN Jacobian with respect to W_2",
                                     "the FFN Jacobian with respect to Y",
                                     "the FFN Jacobian with respect to Y (blocks)",
                                     "the Kronecker factors of the FFN Jacobian with respect to W_1",
                                     "the Kronecker factors of the FFN Jacobian with respect to W_2"};
  const std::string what = name[static_cast<int>(kind)];
  const index_t L = s.L, d = s.d, f = s.f, e = s.e;
  FiniteRecord finite;  // every entry checked as it is written
  detail::named(what, [&] {
    auto w = detail::ffn(Y, W_1, W_2, s, backend);
    engine::Graph<T>& g = *w.graph;
    switch (kind) {
      case FfnJacobian::W_1: engine::jacobian(g, detail::kW1, out, &finite); break;
      case FfnJacobian::W_2: engine::jacobian(g, detail::kW2, out, &finite); break;
      case FfnJacobian::Y_blocks: detail::ffn_input_blocks(w, s, out, finite); break;
      case FfnJacobian::Y: {
        BackendBuffer<T> blocks(backend, L * e * d);
        detail::ffn_input_blocks(w, s, blocks.data(), finite);
        backend.run(engine::rows::BlockDiagonalRows<T>{blocks.data(), out, L, e, d}, L * e);
        break;
      }
      case FfnJacobian::W_1_factor: {
        // W_1's tangent factor at the output: U_t = W_2^T relu'(H_t) as (e, f), without its vec Y_t.
        g.select({true, false});
        g.push_factors(/*to_output=*/true);
        const engine::Factor<T>& factor = g.factor(g.output(), g.whole(detail::kW1));
        finite.note(engine::factor_rows(g, factor, static_cast<const T*>(nullptr), out, f));
        break;
      }
      case FfnJacobian::W_2_factor:
        g.copy(g.value(w.hidden), out, L * f);
        finite.note(backend.all_finite(out, L * f));
        break;
    }
  });
  finite.require<T>(what);
}

template <class T>
void ffn_cross_hessian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnCross kind, T* out,
                       const Backend<T>& backend) {
  const bool dense = kind == FfnCross::dense;
  const std::string what = dense ? "the dense FFN cross second derivative" : "the FFN cross second-derivative blocks";
  const index_t L = s.L, d = s.d, f = s.f, e = s.e;
  FiniteRecord finite;  // the values, checked as they are formed
  detail::named(what, [&] {
    auto w = detail::ffn(Y, W_1, W_2, s, backend);
    engine::Graph<T>& g = *w.graph;
    // The one bilinear term <gF, dR dW_2> pairs W_2 with W_1's factor at the hidden units R:
    // vec Y_t on W_1's rows and G_t = diag(relu'(H_t)), whose products are the values: each
    // token's (d, f) block is the one row of Y_t (x) diag(G_t).
    g.select({true, false});
    g.push_factors(/*to_output=*/false);
    const engine::Factor<T>& factor = g.factor(w.hidden, g.whole(detail::kW1));
    if (factor.form != engine::Form::diagonal || factor.right)
      throw std::logic_error("ffn_cross_hessian: W_1's factor after the activation is a diagonal");
    BackendBuffer<T> values_buffer(backend, dense ? L * d * f : 0);
    T* values = dense ? values_buffer.data() : out;
    finite.note(engine::outer_rows(backend, L, factor.vec->data(), factor.U->data(), engine::rows::FactorLayout::by_rows,
                                   1, factor.split, values, d * f));
    if (dense) backend.run(engine::rows::CrossLayoutRows<T>{values, out, d, f, e}, L * e * d * f);
  });
  finite.require<T>(what);
}

}  // namespace blockhess::components
