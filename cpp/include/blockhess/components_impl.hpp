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

// A sublayer's graph after its forward pass (or, with no input values, wired for its shapes only:
// engine/working_memory.hpp): its input value, (FFN) its hidden units relu(Y W_1), (attention) its
// node. The parameters are the graph's 0, 1 (and 2), in the order of the function's arguments.
template <class T>
struct Wired {
  Wired(const T* input_values, index_t L, index_t width)
      : graph(std::make_unique<engine::Graph<T>>(1, L)), input(graph->input(input_values, width)) {}
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
Wired<T> attention(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s) {
  require_sizes("attention", {{"L", s.L}, {"d", s.d}, {"d_k", s.dk}, {"d_v", s.dv}});
  Wired<T> w(X, s.L, s.d);
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
Wired<T> ffn(const T* Y, const T* W_1, const T* W_2, const FfnDims& s) {
  require_sizes("ffn", {{"L", s.L}, {"d", s.d}, {"d_ff", s.f}, {"d_out", s.e}});
  Wired<T> w(Y, s.L, s.d);
  engine::Graph<T>& g = *w.graph;
  const int w1 = g.param("W_1", s.d, s.f, W_1, engine::Storage::borrow);
  const int w2 = g.param("W_2", s.f, s.e, W_2, engine::Storage::borrow);
  const int H = g.add(std::make_unique<engine::LinearNode<T>>("the FFN pre-activations Y W_1"), {w.input}, {w1}, s.f);
  w.hidden = g.add(std::make_unique<engine::PointwiseNode<T>>(activation::Kind::relu), {H}, {}, s.f);
  g.set_output(g.add(std::make_unique<engine::LinearNode<T>>("the FFN output relu(Y W_1) W_2"), {w.hidden}, {w2}, s.e));
  if (Y) g.forward();
  return w;
}

// The diagonal blocks of dF/dY of the FFN, (L, e, d). The FFN acts on each token alone, so one
// tangent that moves feature b of every token at once gives column b of every token's block: d
// tangents, not L d.
template <class T>
void ffn_input_blocks(const Wired<T>& w, const FfnDims& s, T* blocks, FiniteRecord& finite) {
  const index_t L = s.L, d = s.d, e = s.e;
  engine::input_tangents(
      *w.graph, w.input, d, L * s.f * (d + e),
      [&](index_t b, T* dY) {
        for (index_t k = 0; k < L * d; ++k) dY[k] = k % d == b ? T(1) : T(0);
      },
      [&](index_t b, const T* dF) {
        for (index_t row = 0; row < L * e; ++row) blocks[row * d + b] = dF ? dF[row] : T(0);
        if (dF) finite.check(dF, L * e);
      });
}

// The dense (L e, L d) Jacobian from its diagonal blocks (L, e, d), one row at a time.
template <class T>
void block_diagonal(const T* blocks, index_t L, index_t e, index_t d, T* dense) {
  blockhess::detail::parallel_for(L * e, L * d, [&](index_t row) {
    T* out = dense + row * L * d;
    std::fill_n(out, L * d, T(0));
    std::copy_n(blocks + row * d, d, out + (row / e) * d);
  });
}

// The diagonal of U_t (n, n) of a factor: the identity's ones, a diagonal form's values, else read
// from the materialised matrix.
template <class T>
void factor_diagonal(const engine::Factor<T>& f, index_t t, index_t n, T* out) {
  if (f.form == engine::Form::identity && !f.right) {
    std::fill_n(out, n, T(1));
  } else if (f.form == engine::Form::diagonal && !f.right) {
    std::copy_n(f.diagonal_t(t), n, out);
  } else {
    Mat<T> U;
    f.materialise(t, U);
    for (index_t k = 0; k < n; ++k) out[k] = U(k, k);
  }
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
void attention_forward(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s, T* F) {
  detail::named("the attention output", [&] {
    const auto w = detail::attention(X, W_Q, W_K, W_V, s);
    std::copy_n(w.graph->value(w.graph->output()), s.L * s.dv, F);
  });
}

template <class T>
void attention_jacobian(const T* X, const T* W_Q, const T* W_K, const T* W_V, const AttentionDims& s,
                        AttentionWrt wrt, T* J) {
  static const char* const name[] = {"W_Q", "W_K", "W_V", "X"};
  const std::string what = std::string("the attention Jacobian with respect to ") + name[static_cast<int>(wrt)];
  FiniteRecord finite;  // every entry checked as it is written
  detail::named(what, [&] {
    auto w = detail::attention(X, W_Q, W_K, W_V, s);
    if (wrt == AttentionWrt::X) w.attention->input_jacobian(*w.graph, 0, J, &finite);  // its closed form
    else engine::jacobian(*w.graph, static_cast<int>(wrt), J, &finite);  // the graph's parameter wrt
  });
  finite.require<T>(what);
}

template <class T>
void ffn_forward(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, T* F) {
  detail::named("the FFN output", [&] {
    const auto w = detail::ffn(Y, W_1, W_2, s);
    std::copy_n(w.graph->value(w.graph->output()), s.L * s.e, F);
  });
}

template <class T>
void ffn_jacobian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnJacobian kind, T* out) {
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
    auto w = detail::ffn(Y, W_1, W_2, s);
    engine::Graph<T>& g = *w.graph;
    switch (kind) {
      case FfnJacobian::W_1: engine::jacobian(g, detail::kW1, out, &finite); break;
      case FfnJacobian::W_2: engine::jacobian(g, detail::kW2, out, &finite); break;
      case FfnJacobian::Y_blocks: detail::ffn_input_blocks(w, s, out, finite); break;
      case FfnJacobian::Y: {
        Buffer<T> blocks(L * e * d);
        detail::ffn_input_blocks(w, s, blocks.data(), finite);
        detail::block_diagonal(blocks.data(), L, e, d, out);
        break;
      }
      case FfnJacobian::W_1_factor: {
        // W_1's tangent factor at the output: vec Y_t, U_t = W_2^T relu'(H_t) as (e, f).
        g.select({true, false});
        g.push_factors(/*to_output=*/true);
        const engine::Factor<T>& factor = g.factor(g.output(), g.whole(detail::kW1));
        blockhess::detail::parallel_for(L, e * f, [&](index_t t) {
          Mat<T> U;
          factor.materialise(t, U);
          std::copy_n(U.data(), e * f, out + t * e * f);
          finite.check(out + t * e * f, e * f);
        });
        break;
      }
      case FfnJacobian::W_2_factor:
        std::copy_n(g.value(w.hidden), L * f, out);
        finite.check(out, L * f);
        break;
    }
  });
  finite.require<T>(what);
}

template <class T>
void ffn_cross_hessian(const T* Y, const T* W_1, const T* W_2, const FfnDims& s, FfnCross kind, T* out) {
  const bool dense = kind == FfnCross::dense;
  const std::string what = dense ? "the dense FFN cross second derivative" : "the FFN cross second-derivative blocks";
  const index_t L = s.L, d = s.d, f = s.f, e = s.e;
  FiniteRecord finite;  // the values, checked as they are formed
  detail::named(what, [&] {
    auto w = detail::ffn(Y, W_1, W_2, s);
    engine::Graph<T>& g = *w.graph;
    // The one bilinear term <gF, dR dW_2> pairs W_2 with W_1's factor at the hidden units R:
    // vec Y_t on W_1's rows and U_t = diag(relu'(H_t)), whose products are the values.
    g.select({true, false});
    g.push_factors(/*to_output=*/false);
    const engine::Factor<T>& factor = g.factor(w.hidden, g.whole(detail::kW1));
    Buffer<T> values_buffer(dense ? L * d * f : 0);
    T* values = dense ? values_buffer.data() : out;
    blockhess::detail::parallel_for(L, d * f, [&](index_t t) {
      Buffer<T> mask(f);
      detail::factor_diagonal(factor, t, f, mask.data());
      const T* y = factor.vec->data() + t * d;
      T* o = values + t * d * f;
      for (index_t b = 0; b < d; ++b)
        for (index_t k = 0; k < f; ++k) o[b * f + k] = y[b] * mask[k];
      finite.check(o, d * f);
    });
    if (!dense) return;
    // The paper's layout: row (t e + c) d f + b f + k holds the value at column k e + c.
    blockhess::detail::parallel_for(L * e, d * f * f * e, [&](index_t te) {
      const index_t t = te / e, c = te % e;
      for (index_t bk = 0; bk < d * f; ++bk) {
        T* row = out + (te * d * f + bk) * f * e;
        std::fill_n(row, f * e, T(0));
        row[(bk % f) * e + c] = values[t * d * f + bk];
      }
    });
  });
  finite.require<T>(what);
}

}  // namespace blockhess::components
