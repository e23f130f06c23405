// Cross-entropy per token, each row of Z a logit vector against its class:
//   l = 1/(B L) sum_t [logsumexp(Z_t) - Z_t[class_t]]
// formed in that form (softmax::cross_entropy_row), so large logit gaps stay finite. Separable over
// tokens: its second derivative is the d x d block 1/(B L) (diag p_t - p_t p_t^T) per token,
// p_t = softmax(Z_t), a site at Z. With ignoring, a token whose class is kIgnoredClass counts for
// nothing and the mean is over the others (1/n_counted in place of 1/(B L)): the next-token loss
// (next_token.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>

#include "blockhess/buffer.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/rows/heads.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine {

// The class of a token that counts for nothing (Hugging Face's and torch's ignore_index).
inline constexpr std::int64_t kIgnoredClass = -100;

template <class T>
class CrossEntropyHead final : public Head<T> {
 public:
  // classes: one per token in the graph's backend's memory, read while the head lives. ignoring: kIgnoredClass drops a token.
  explicit CrossEntropyHead(const std::int64_t* classes, bool ignoring = false)
      : classes_(classes), ignoring_(ignoring) {
    if (!classes_) throw std::invalid_argument("loss: cross_entropy needs integer class targets");
  }

  // An ignored token counts for nothing: no loss, no gradient, no curvature (p_t = 0).
  T forward(const Graph<T>& g, T* gZ) override {
    const index_t n = g.tokens(), d = g.width(g.output());
    const HostView<std::int64_t, T> classes(g.backend(), classes_, n);
    index_t counted = 0;
    for (index_t t = 0; t < n; ++t) {
      const std::int64_t k = classes.data()[t];
      if (ignoring_ && k == kIgnoredClass) continue;
      require_class(k, d);
      ++counted;
    }
    if (counted == 0) throw std::invalid_argument("loss: every token's label is ignored (-100): the mean is over none");
    scale_ = T(1) / static_cast<T>(counted);
    p_.resize(g.backend(), n * d);
    g.backend().run(rows::CrossEntropyRows<T>{g.value(g.output()), classes_, p_.data(), gZ, this->row_losses(g, n), d,
                                              scale_, ignoring_, kIgnoredClass},
                    n);
    return this->total_loss(g, n);
  }

  // p; a (d, d) Omega a token.
  index_t footprint(const Graph<T>& g, bool site) const override {
    const index_t d = g.width(g.output());
    return g.tokens() * (d + (site ? d * d : 0));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    const index_t n = g.tokens(), d = g.width(g.output());
    auto omega = std::make_shared<Buffer<T>>(static_cast<size_t>(n * d * d));
    for (index_t t = 0; t < n; ++t) {
      const T* p = p_.data() + t * d;
      T* O = omega->data() + t * d * d;
      for (index_t a = 0; a < d; ++a)
        for (index_t b = 0; b < d; ++b) O[a * d + b] = scale_ * ((a == b ? p[a] : T(0)) - p[a] * p[b]);
    }
    terms.sites.push_back(Site<T>{g.output(), std::move(omega), false});
  }

  // Column c of each token's sqrt(1/(B L)) (diag sqrt(p) - p sqrt(p)^T): sqrt(p_c / (B L)) (e_c - p).
  index_t root_columns(const Graph<T>& g) const override { return g.width(g.output()); }
  void root_column(const Graph<T>& g, index_t c, T* S) const override {
    const index_t n = g.tokens(), d = g.width(g.output());
    for (index_t t = 0; t < n; ++t) {
      const T* p = p_.data() + t * d;
      const T root = std::sqrt(scale_ * p[c]);  // 0 for an ignored token (p = 0)
      for (index_t a = 0; a < d; ++a) S[t * d + a] = root * ((a == c ? T(1) : T(0)) - p[a]);
    }
  }

  // Per row: 1/(B L) (p * dz - p (p . dz)).
  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override {
    g.backend().run(rows::CrossEntropyTangentRows<T>{p_.data(), dZ, dgZ, g.width(g.output()), scale_}, g.tokens());
  }

 private:
  const std::int64_t* classes_;
  bool ignoring_;
  T scale_ = 0;  // 1 / (B L), or 1 / the tokens counted
  BackendBuffer<T> p_;  // softmax(Z_t), (tokens, d)
};

}  // namespace blockhess::engine
