// The post-LN Transformer block of docs/derivation.md §2.1, for a batch of B samples:
//   T = X W_Q W_K^T X^T / sqrt(d_k),  A = softmax_rows(T),  F = A X W_V,
//   Y = LN(X + F),  R = relu(Y W_1),  S = R W_2 + Y,  Z = LN(S)
// (no biases, LayerNorm without affine parameters, optional eps), evaluated by the curvature engine
// (engine/graph.hpp) on its wiring (blocks/post_ln.hpp). This header holds the forward pass and the
// reverse pass that carries a cotangent of Z back to every intermediate and to the weights.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "blockhess/blocks/post_ln.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/params.hpp"

namespace blockhess::block {

template <class T>
struct Weights {
  std::array<const T*, kNumParams> w{};  // row-major, shapes Dims::rows(p) x Dims::cols(p)
};

// The block evaluated at one input (its forward pass done): the engine graph and its caches.
template <class T>
class Evaluation {
 public:
  Evaluation(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps)
      : dims_(D), graph_(std::make_unique<engine::Graph<T>>(B, checked(D).L)) {
    values_ = blocks::wire_post_ln(*graph_, D, X, W.w, eps);
    graph_->forward();
  }

  const Dims& dims() const { return dims_; }
  index_t samples() const { return graph_->samples(); }
  index_t tokens() const { return graph_->tokens(); }
  const T* output() const { return graph_->value(values_.Z); }
  engine::Graph<T>& graph() { return *graph_; }
  const engine::Graph<T>& graph() const { return *graph_; }

  // Carries gZ (B*L, d) back through the block; writes the gradient of the weights (concatenated
  // in Param order) when grad is not null.
  void reverse(const T* gZ, T* grad = nullptr) {
    std::vector<T*> gradient(kNumParams, nullptr);
    if (grad)
      for (int p = 0, offset = 0; p < kNumParams; offset += static_cast<int>(dims_.size(p)), ++p) gradient[p] = grad + offset;
    graph_->reverse(gZ, std::move(gradient));
    const index_t n = tokens() * dims_.d;
    require_finite(graph_->cotangent(values_.S), n, "block: the reverse pass through the second LayerNorm");
    require_finite(graph_->cotangent(values_.S1), n, "block: the reverse pass through the FFN and the first LayerNorm");
  }

 private:
  static const Dims& checked(const Dims& D) {
    D.check();
    return D;
  }

  Dims dims_;
  std::unique_ptr<engine::Graph<T>> graph_;
  blocks::PostLnValues values_;
};

template <class T>
Evaluation<T> forward(const Dims& dims, index_t B, const T* X, const Weights<T>& W, T eps) {
  return Evaluation<T>(dims, B, X, W, eps);
}

}  // namespace blockhess::block
