// The losses by name: the one registry of heads (engine/heads/), which Python reads
// (blockhess._core.losses: the functions' `loss=`, the command lines). A loss's code is its index
// here; make() is the one place a code becomes a head.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "blockhess/config.hpp"
#include "blockhess/engine/heads/cross_entropy.hpp"
#include "blockhess/engine/heads/first_token.hpp"
#include "blockhess/engine/heads/mse.hpp"
#include "blockhess/engine/heads/next_token.hpp"
#include "blockhess/engine/heads/pooled_cross_entropy.hpp"

namespace blockhess::heads {

inline constexpr std::array<const char*, 4> kNames{"mse", "cross_entropy", "pooled_cross_entropy", "next_token"};
inline constexpr int kPooledCrossEntropy = 2;  // the head that takes a classifier and one class per sample
inline constexpr int kNextToken = 3;           // labels (samples, L), shifted, -100 ignored

// The fixed classifier of pooled_cross_entropy: W_C (d, classes) row-major and b_C (classes); both
// null where the model has a classifier of its own (its output is the logits). first_token: the
// model pools its class token (each sample's first row) instead of the mean.
template <class T>
struct Classifier {
  const T* weight = nullptr;
  const T* bias = nullptr;
  index_t classes = 0;
  bool first_token = false;
};

// What a loss is measured against: float targets (mse: (tokens, d)) or class indices
// (cross_entropy: one per token; pooled_cross_entropy: one per sample, through `classifier`;
// next_token: each token's label, the loss reading the next one's).
// The head reads them when its forward pass runs.
template <class T>
struct Target {
  int loss = 0;  // a code: the index of its name in kNames
  const T* values = nullptr;
  const std::int64_t* classes = nullptr;
  Classifier<T> classifier;
};

template <class T>
std::unique_ptr<engine::Head<T>> make(const Target<T>& t) {
  switch (t.loss) {
    case 0:
      return std::make_unique<engine::MseHead<T>>(t.values);
    case 1:
      return std::make_unique<engine::CrossEntropyHead<T>>(t.classes);
    case kPooledCrossEntropy:
      if (t.classifier.first_token) return std::make_unique<engine::FirstTokenCrossEntropyHead<T>>(t.classes);
      return std::make_unique<engine::PooledCrossEntropyHead<T>>(t.classes, t.classifier.weight, t.classifier.bias,
                                                                 t.classifier.classes);
    case kNextToken:
      return std::make_unique<engine::NextTokenHead<T>>(t.classes);
    default:
      throw std::invalid_argument("loss: unknown code " + std::to_string(t.loss) + " (0 to " +
                                  std::to_string(kNames.size() - 1) + ")");
  }
}

}  // namespace blockhess::heads
