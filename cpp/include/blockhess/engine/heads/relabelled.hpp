// A head that is the per-token cross-entropy (cross_entropy.hpp) against classes it derives from
// its own target when the forward pass runs: each token's class, or kIgnoredClass for a token that
// counts for nothing (the mean is over the others). The next-token loss (next_token.hpp) and a class
// token's loss (first_token.hpp) are two such relabellings; the formulas stay cross_entropy.hpp's.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/heads/cross_entropy.hpp"

namespace blockhess::engine {

template <class T>
class RelabelledCrossEntropy : public Head<T> {
 public:
  // The classes relabelled on the host (from the target read there) and put in the backend's
  // memory, where the per-token head reads them.
  T forward(const Graph<T>& g, T* gZ) override {
    std::vector<std::int64_t> classes(static_cast<size_t>(g.tokens()), kIgnoredClass);
    relabel(g, classes.data());
    classes_.assign(g.backend(), classes.data(), g.tokens());
    per_token_ = std::make_unique<CrossEntropyHead<T>>(classes_.data(), /*ignoring=*/true);
    return per_token_->forward(g, gZ);
  }
  void curvature(const Graph<T>& g, Terms<T>& terms) const override { per_token_->curvature(g, terms); }
  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override { per_token_->vjp_tangent(g, dZ, dgZ); }
  index_t root_columns(const Graph<T>& g) const override { return per_token_->root_columns(g); }
  // The relabelled classes (on the host and in the backend's memory; and the target's read on the
  // host), and the per-token head's (p, and its site).
  index_t footprint(const Graph<T>& g, bool site) const override {
    const index_t d = g.width(g.output());
    return g.tokens() * (3 * static_cast<index_t>(sizeof(std::int64_t) / sizeof(T)) + d + (site ? d * d : 0));
  }
  void root_column(const Graph<T>& g, index_t c, T* S) const override { per_token_->root_column(g, c, S); }

 protected:
  // Writes each token's class into classes (g.tokens() entries in the host's memory, all
  // kIgnoredClass on entry), from a target in the graph's backend's memory.
  virtual void relabel(const Graph<T>& g, std::int64_t* classes) const = 0;

 private:
  BackendBuffer<T, std::int64_t> classes_;
  std::unique_ptr<CrossEntropyHead<T>> per_token_;
};

}  // namespace blockhess::engine
