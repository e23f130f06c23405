// The causal language model's loss, as Hugging Face's GPT-2 defines it: the logits at positions
// 0..L-2 of each sample against the labels at positions 1..L-1, labels of -100 ignored, the mean
// over the tokens that remain. It is the per-token cross-entropy against the labels shifted left
// by one, the last position of every sample ignored (relabelled.hpp).
#pragma once

#include <cstdint>
#include <stdexcept>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/engine/heads/relabelled.hpp"

namespace blockhess::engine {

template <class T>
class NextTokenHead final : public RelabelledCrossEntropy<T> {
 public:
  // labels: (samples, L) in the graph's backend's memory, read when forward runs.
  explicit NextTokenHead(const std::int64_t* labels) : labels_(labels) {
    if (!labels_) throw std::invalid_argument("loss: next_token needs integer labels");
  }

 private:
  void relabel(const Graph<T>& g, std::int64_t* classes) const override {
    const index_t L = g.tokens_per_sample();
    const HostView<std::int64_t, T> labels(g.backend(), labels_, g.tokens());
    for (index_t t = 0; t < g.tokens(); ++t)
      if ((t + 1) % L != 0) classes[t] = labels.data()[t + 1];  // a sample's last token has no next one
  }

  const std::int64_t* labels_;
};

}  // namespace blockhess::engine
