// The causal language model's loss, as Hugging Face's GPT-2 defines it: the logits at positions
// 0..L-2 of each sample against the labels at positions 1..L-1, labels of -100 ignored, the mean
// over the tokens that remain. It is the per-token cross-entropy (cross_entropy.hpp) against the
// labels shifted left by one, the last position of every sample ignored.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "blockhess/engine/head.hpp"
#include "blockhess/engine/heads/cross_entropy.hpp"

namespace blockhess::engine {

template <class T>
class NextTokenHead final : public Head<T> {
 public:
  // labels: (samples, L), read when forward runs.
  explicit NextTokenHead(const std::int64_t* labels) : labels_(labels) {
    if (!labels_) throw std::invalid_argument("loss: next_token needs integer labels");
  }

  T forward(const Graph<T>& g, T* gZ) override {
    const index_t L = g.tokens_per_sample(), n = g.tokens();
    shifted_.assign(static_cast<size_t>(n), kIgnoredClass);
    for (index_t t = 0; t < n; ++t)
      if ((t + 1) % L != 0) shifted_[static_cast<size_t>(t)] = labels_[t + 1];
    per_token_ = std::make_unique<CrossEntropyHead<T>>(shifted_.data(), /*ignoring=*/true);
    return per_token_->forward(g, gZ);
  }
  void curvature(const Graph<T>& g, Terms<T>& terms) const override { per_token_->curvature(g, terms); }
  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override { per_token_->vjp_tangent(g, dZ, dgZ); }

 private:
  const std::int64_t* labels_;
  std::vector<std::int64_t> shifted_;  // token t's class: the next token's label (ignored at a sample's end)
  std::unique_ptr<CrossEntropyHead<T>> per_token_;
};

}  // namespace blockhess::engine
