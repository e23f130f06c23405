// A class-token classifier's loss (a ViT's, Hugging Face's ViTForImageClassification): each
// sample's first row of Z is its logits, against one class per sample,
//   l = 1/B sum_b [logsumexp(Z_b,0) - Z_b,0[class_b]].
// It is the per-token cross-entropy with every other token ignored (relabelled.hpp): separable, a
// site at Z on the first tokens.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/engine/heads/relabelled.hpp"

namespace blockhess::engine {

template <class T>
class FirstTokenCrossEntropyHead final : public RelabelledCrossEntropy<T> {
 public:
  // classes: one per sample in the graph's backend's memory, read when forward runs.
  explicit FirstTokenCrossEntropyHead(const std::int64_t* classes) : classes_(classes) {
    if (!classes_) throw std::invalid_argument("loss: pooled_cross_entropy needs integer class targets");
  }

 private:
  void relabel(const Graph<T>& g, std::int64_t* classes) const override {
    const HostView<std::int64_t, T> targets(g.backend(), classes_, g.samples());
    for (index_t b = 0; b < g.samples(); ++b) classes[b * g.tokens_per_sample()] = targets.data()[b];
  }

  const std::int64_t* classes_;
};

}  // namespace blockhess::engine
