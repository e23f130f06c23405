// A Transformer block of the family (params.hpp's Spec), for a batch of B samples; the default is
// the paper's post-LN block of docs/derivation.md §2.1:
//   T = X W_Q W_K^T X^T / sqrt(d_k),  A = softmax_rows(T),  F = A X W_V,
//   Y = LN(X + F),  R = relu(Y W_1),  S = R W_2 + Y,  Z = LN(S)
// (no biases, LayerNorm without affine parameters, optional eps). It is evaluated by the curvature
// engine (engine/graph.hpp) on its wiring (blocks/). This header holds the forward pass and the
// reverse pass that carries a cotangent of Z back to every intermediate and to the parameters.
#pragma once

#include <memory>
#include <vector>

#include "blockhess/blocks/family.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/params.hpp"

namespace blockhess::block {

// The block evaluated at one input (its forward pass done): the engine graph and its caches.
template <class T>
class Evaluation {
 public:
  // weights: one row-major array per parameters(spec, D) entry, in that order; copied, or with
  // Storage::borrow read in place for the evaluation's lifetime (engine/graph.hpp).
  Evaluation(const Spec& spec, const Dims& D, index_t B, const T* X, const std::vector<const T*>& weights, T eps,
             engine::Storage storage = engine::Storage::copy)
      : spec_(spec), dims_(D), shapes_(parameters(spec, D)), graph_(std::make_unique<engine::Graph<T>>(B, checked(spec, D).L)) {
    values_ = blocks::wire(*graph_, spec, D, X, weights, eps, storage);
    graph_->forward();
  }

  const Spec& spec() const { return spec_; }
  const std::vector<ParamShape>& shapes() const { return shapes_; }
  const Dims& dims() const { return dims_; }
  index_t samples() const { return graph_->samples(); }
  index_t tokens() const { return graph_->tokens(); }
  const T* output() const { return graph_->value(values_.Z); }
  engine::Graph<T>& graph() { return *graph_; }
  const engine::Graph<T>& graph() const { return *graph_; }

  // Carries gZ (B*L, d) back through the block; writes the gradient of the parameters
  // (concatenated in the canonical order) when grad is not null.
  void reverse(const T* gZ, T* grad = nullptr) {
    std::vector<T*> gradient(shapes_.size(), nullptr);
    if (grad)
      for (size_t p = 0, offset = 0; p < shapes_.size(); offset += static_cast<size_t>(shapes_[p].size()), ++p)
        gradient[p] = grad + offset;
    graph_->reverse(gZ, std::move(gradient));
    if (values_.ffn_sum < 0) return;  // attention only: no stage between Z and the attention
    const index_t n = tokens() * dims_.d;
    require_finite(graph_->cotangent(values_.ffn_sum), n, "block: the reverse pass through the output's norm");
    require_finite(graph_->cotangent(values_.attention_sum), n, "block: the reverse pass through the FFN and the first norm");
  }

 private:
  static const Dims& checked(const Spec& spec, const Dims& D) {
    D.check(!spec.attention_only);
    return D;
  }

  Spec spec_;
  Dims dims_;
  std::vector<ParamShape> shapes_;
  std::unique_ptr<engine::Graph<T>> graph_;
  blocks::Values values_;
};

template <class T>
Evaluation<T> forward(const Spec& spec, const Dims& dims, index_t B, const T* X, const std::vector<const T*>& weights, T eps,
                      engine::Storage storage = engine::Storage::copy) {
  return Evaluation<T>(spec, dims, B, X, weights, eps, storage);
}

}  // namespace blockhess::block
