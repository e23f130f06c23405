// A class-token classifier's loss (a ViT's, Hugging Face's ViTForImageClassification): each
// sample's first row of Z is its logits, against one class per sample,
//   l = 1/B sum_b [logsumexp(Z_b,0) - Z_b,0[class_b]].
// It is the per-token cross-entropy (cross_entropy.hpp) with every other token ignored: separable,
// a site at Z on the first tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "blockhess/engine/head.hpp"
#include "blockhess/engine/heads/cross_entropy.hpp"

namespace blockhess::engine {

template <class T>
class FirstTokenCrossEntropyHead final : public Head<T> {
 public:
  // classes: one per sample, read when forward runs.
  explicit FirstTokenCrossEntropyHead(const std::int64_t* classes) : classes_(classes) {
    if (!classes_) throw std::invalid_argument("loss: pooled_cross_entropy needs integer class targets");
  }

  T forward(const Graph<T>& g, T* gZ) override {
    const index_t L = g.tokens_per_sample();
    per_token_classes_.assign(static_cast<size_t>(g.tokens()), kIgnoredClass);
    for (index_t b = 0; b < g.samples(); ++b) per_token_classes_[static_cast<size_t>(b * L)] = classes_[b];
    per_token_ = std::make_unique<CrossEntropyHead<T>>(per_token_classes_.data(), /*ignoring=*/true);
    return per_token_->forward(g, gZ);
  }
  void curvature(const Graph<T>& g, Terms<T>& terms) const override { per_token_->curvature(g, terms); }
  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override { per_token_->vjp_tangent(g, dZ, dgZ); }

 private:
  const std::int64_t* classes_;
  std::vector<std::int64_t> per_token_classes_;  // the sample's class at its first token, else ignored
  std::unique_ptr<CrossEntropyHead<T>> per_token_;
};

}  // namespace blockhess::engine
