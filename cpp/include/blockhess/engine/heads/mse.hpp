// Mean squared error against a float target: l = 1/(B L d) sum (Z - target)^2 (docs/derivation.md
// §2.2; per sample 1/(L d) ||Z - target||_F^2). Its second derivative is 2/(B L d) I at every
// token: a diagonal site at Z.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>

#include "blockhess/buffer.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/heads.hpp"

namespace blockhess::engine {

template <class T>
class MseHead final : public Head<T> {
 public:
  // target: (tokens, width) row-major in the graph's backend's memory, read while the head lives.
  explicit MseHead(const T* target) : target_(target) {
    if (!target_) throw std::invalid_argument("loss: mse needs a float target");
  }

  T forward(const Graph<T>& g, T* gZ) override {
    const index_t n = g.tokens(), d = g.width(g.output());
    scale_ = T(1) / static_cast<T>(n * d);
    g.backend().run(rows::MseRows<T>{g.value(g.output()), target_, gZ, this->row_losses(g, n), d, scale_}, n);
    return this->total_loss(g, n);
  }

  // Its site's diagonal.
  index_t footprint(const Graph<T>& g, bool site) const override {
    return site ? g.tokens() * g.width(g.output()) : 0;
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    const index_t n = g.tokens() * g.width(g.output());
    terms.sites.push_back(Site<T>{g.output(), std::make_shared<const Buffer<T>>(static_cast<size_t>(n), 2 * scale_), true});
  }

  // sqrt(2 / (B L d)) e_c at every token.
  index_t root_columns(const Graph<T>& g) const override { return g.width(g.output()); }
  void root_column(const Graph<T>& g, index_t c, T* S) const override {
    const index_t n = g.tokens(), d = g.width(g.output());
    std::fill_n(S, n * d, T(0));
    const T root = std::sqrt(2 * scale_);
    for (index_t t = 0; t < n; ++t) S[t * d + c] = root;
  }

  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override {
    g.backend().run(rows::ScaleBy<T>{2 * scale_, dZ, dgZ}, g.tokens() * g.width(g.output()));
  }

 private:
  const T* target_;
  T scale_ = 0;  // 1 / (B L d)
};

}  // namespace blockhess::engine
