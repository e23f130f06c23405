// The paper's ViT classifier head (docs/derivation.md §2.2): each sample's tokens are averaged and
// classified by a fixed linear map,
//   m_b = 1/L sum_t Z_b,t,  logits_b = m_b W_C + b_C,  l = 1/B sum_b [logsumexp(logits_b) - logits_b[class_b]].
// The mean couples every pair of tokens of a sample: d2l / dZ_b,t dZ_b,s = 1/(B L^2) W_C Omega_b W_C^T
// (Omega_b = diag p_b - p_b p_b^T) is one d x d block per sample, the same for every pair (t, s): a
// pooled site at Z. Without (W_C, b_C) the rows of Z are the logits themselves (W_C = I, b_C = 0):
// a model whose own classifier node writes per-token logits (params.hpp's Stack::classes), whose
// mean is the logits of the mean.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "blockhess/buffer.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine {

template <class T>
class PooledCrossEntropyHead final : public Head<T> {
 public:
  // classes: one per sample; weight: W_C (d, C) row-major; bias: b_C (C), both null for the
  // identity (Z's rows are the logits, d = C). Read while the head lives.
  PooledCrossEntropyHead(const std::int64_t* classes, const T* weight, const T* bias, index_t C)
      : classes_(classes), W_(weight), b_(bias), C_(C) {
    if (!classes_) throw std::invalid_argument("loss: pooled_cross_entropy needs integer class targets");
    if (!W_ != !b_ || C_ < 1) throw std::invalid_argument("loss: pooled_cross_entropy needs a head (W_C, b_C)");
  }

  bool couples_tokens() const override { return true; }
  // p and the per-sample (d, d) blocks (forward forms them either way).
  index_t footprint(const Graph<T>& g, bool) const override {
    const index_t d = g.width(g.output());
    return g.samples() * (C_ + d * d) + 4 * (d + C_);
  }

  // The loss, its gradient (the same row 1/(B L) W_C (p_b - e_class) for every token of sample b)
  // and the per-sample blocks of its second derivative (B d^2 numbers: the HVP's seed needs them too).
  T forward(const Graph<T>& g, T* gZ) override {
    g.require_host("the pooled cross-entropy");
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(g.output());
    const T* Z = g.value(g.output());
    if (!W_ && d != C_) throw std::logic_error("loss: pooled logits of width " + std::to_string(d) + " for " +
                                               std::to_string(C_) + " classes");
    blocks_ = std::make_shared<Buffer<T>>(static_cast<size_t>(B * d * d));
    p_.resize(static_cast<size_t>(B * C_));
    Buffer<T> m(d), logits(C_), p(C_), gm(d);
    const T inv_B = T(1) / static_cast<T>(B), inv_L = T(1) / static_cast<T>(L);
    T value = 0;
    for (index_t b = 0; b < B; ++b) {
      const std::int64_t k = classes_[b];
      require_class(k, C_);
      std::fill(m.begin(), m.end(), T(0));
      for (index_t t = 0; t < L; ++t)
        for (index_t a = 0; a < d; ++a) m[a] += Z[(b * L + t) * d + a];
      for (index_t a = 0; a < d; ++a) m[a] *= inv_L;
      for (index_t c = 0; c < C_; ++c) {
        T s = b_ ? b_[c] : T(0);
        for (index_t a = 0; a < d; ++a) s += m[a] * w(a, c);
        logits[c] = s;
      }
      value += inv_B * softmax::cross_entropy_row(logits.data(), C_, k, p.data());
      std::copy(p.begin(), p.end(), p_.begin() + b * C_);
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t c = 0; c < C_; ++c) s += w(a, c) * (p[c] - (c == k ? T(1) : T(0)));
        gm[a] = inv_B * inv_L * s;
      }
      for (index_t t = 0; t < L; ++t) std::copy(gm.begin(), gm.end(), gZ + (b * L + t) * d);
      // 1/(B L^2) W_C (diag p - p p^T) W_C^T = 1/(B L^2) [(W_C diag p) W_C^T - (W_C p)(W_C p)^T].
      for (index_t a = 0; a < d; ++a) {
        T wp = 0;
        for (index_t c = 0; c < C_; ++c) wp += w(a, c) * p[c];
        gm[a] = wp;
      }
      const T scale = inv_B * inv_L * inv_L;
      T* G = blocks_->data() + b * d * d;
      for (index_t a = 0; a < d; ++a)
        for (index_t e = a; e < d; ++e) {
          T s = 0;
          for (index_t c = 0; c < C_; ++c) s += w(a, c) * p[c] * w(e, c);
          G[a * d + e] = G[e * d + a] = scale * (s - gm[a] * gm[e]);  // symmetric by construction
        }
    }
    return value;
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    terms.pooled.push_back(PooledSite<T>{g.output(), blocks_});
  }

  // The logits' block sqrt(1/B) (diag sqrt(p_b) - p_b sqrt(p_b)^T) seen from each token of sample b,
  // whose logits move by W_C^T / L: column c is sqrt(p_b,c / B) / L W_C (e_c - p_b) at every token.
  index_t root_columns(const Graph<T>&) const override { return C_; }
  void root_column(const Graph<T>& g, index_t c, T* S) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(g.output());
    Buffer<T> row(d);
    for (index_t b = 0; b < B; ++b) {
      const T* p = p_.data() + b * C_;
      const T root = std::sqrt(p[c] / static_cast<T>(B)) / static_cast<T>(L);
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t e = 0; e < C_; ++e) s += w(a, e) * ((e == c ? T(1) : T(0)) - p[e]);
        row[a] = root * s;
      }
      for (index_t t = 0; t < L; ++t) std::copy(row.begin(), row.end(), S + (b * L + t) * d);
    }
  }

  // Every row of sample b gets G_b sum_s dZ_b,s.
  void vjp_tangent(const Graph<T>& g, const T* dZ, T* dgZ) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(g.output());
    Buffer<T> sum(d), row(d);
    for (index_t b = 0; b < B; ++b) {
      std::fill(sum.begin(), sum.end(), T(0));
      for (index_t t = 0; t < L; ++t)
        for (index_t a = 0; a < d; ++a) sum[a] += dZ[(b * L + t) * d + a];
      const T* G = blocks_->data() + b * d * d;
      for (index_t a = 0; a < d; ++a) {
        T s = 0;
        for (index_t e = 0; e < d; ++e) s += G[a * d + e] * sum[e];
        row[a] = s;
      }
      for (index_t t = 0; t < L; ++t) std::copy(row.begin(), row.end(), dgZ + (b * L + t) * d);
    }
  }

 private:
  T w(index_t a, index_t c) const { return W_ ? W_[a * C_ + c] : (a == c ? T(1) : T(0)); }  // W_C[a, c]

  const std::int64_t* classes_;
  const T* W_;
  const T* b_;
  index_t C_;
  std::shared_ptr<Buffer<T>> blocks_;  // G_b, (B, d, d)
  Buffer<T> p_;                        // softmax(logits_b), (B, C)
};

}  // namespace blockhess::engine
