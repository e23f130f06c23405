// The paper's ViT classifier head (docs/derivation.md §2.2): each sample's tokens are averaged and
// classified by a fixed linear map,
//   m_b = 1/L sum_t Z_b,t,  logits_b = m_b W_C + b_C,  l = 1/B sum_b [logsumexp(logits_b) - logits_b[class_b]].
// The mean couples every pair of tokens of a sample: d2l / dZ_b,t dZ_b,s = 1/(B L^2) W_C Omega_b W_C^T
// (Omega_b = diag p_b - p_b p_b^T) is one d x d block per sample, the same for every pair (t, s): a
// pooled site at Z. Without (W_C, b_C) the rows of Z are the logits themselves (W_C = I, b_C = 0):
// a model whose own classifier node writes per-token logits (params.hpp's Stack::classes), whose
// mean is the logits of the mean. Its per-sample work is row operations (rows/heads.hpp), so it
// runs on any backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/heads.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine {

template <class T>
class PooledCrossEntropyHead final : public Head<T> {
 public:
  // classes: one per sample; weight: W_C (d, C) row-major; bias: b_C (C), both null for the
  // identity (Z's rows are the logits, d = C); all in the graph's backend's memory, read while the
  // head lives.
  PooledCrossEntropyHead(const std::int64_t* classes, const T* weight, const T* bias, index_t C)
      : classes_(classes), W_(weight), b_(bias), C_(C) {
    if (!classes_) throw std::invalid_argument("loss: pooled_cross_entropy needs integer class targets");
    if (!W_ != !b_ || C_ < 1) throw std::invalid_argument("loss: pooled_cross_entropy needs a head (W_C, b_C)");
  }

  bool couples_tokens() const override { return true; }
  // p, W_C p, the per-sample (d, d) blocks (forward forms them either way), a tangent's sample sums
  // and the curvature's host copy of the blocks.
  index_t footprint(const Graph<T>& g, bool site) const override {
    const index_t d = g.width(g.output());
    return g.samples() * (C_ + 2 * d + d * d * (site ? 2 : 1)) + 4 * (d + C_);
  }

  // The loss, its gradient (the same row 1/(B L) W_C (p_b - e_class) for every token of sample b)
  // and the per-sample blocks of its second derivative (B d^2 numbers: the HVP's seed needs them
  // too), as row operations.
  T forward(const Graph<T>& g, T* gZ) override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(g.output());
    if (!W_ && d != C_) throw std::logic_error("loss: pooled logits of width " + std::to_string(d) + " for " +
                                               std::to_string(C_) + " classes");
    const HostView<std::int64_t, T> classes(g.backend(), classes_, B);
    for (index_t b = 0; b < B; ++b) require_class(classes.data()[b], C_);
    p_.resize(g.backend(), B * C_);
    wp_.resize(g.backend(), B * d);
    blocks_.resize(g.backend(), B * d * d);
    const T inv_B = T(1) / static_cast<T>(B), inv_L = T(1) / static_cast<T>(L);
    g.backend().run(rows::PooledCrossEntropyRows<T>{g.value(g.output()), classes_, W_, b_, p_.data(), wp_.data(), gZ,
                                                    this->row_losses(g, B), L, d, C_, inv_B, inv_L},
                    B);
    // 1/(B L^2) W_C (diag p - p p^T) W_C^T = 1/(B L^2) [(W_C diag p) W_C^T - (W_C p)(W_C p)^T].
    g.backend().run(rows::PooledBlockEntries<T>{p_.data(), wp_.data(), W_, blocks_.data(), d, C_, inv_B * inv_L * inv_L},
                    B * d * d);
    return this->total_loss(g, B);
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    auto blocks = std::make_shared<Buffer<T>>(static_cast<size_t>(blocks_.size()));
    std::copy_n(blocks_.data(), blocks_.size(), blocks->data());
    terms.pooled.push_back(PooledSite<T>{g.output(), std::move(blocks)});
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
    BackendBuffer<T> sums(g.backend(), B * d);  // its own: products run on several tangents at once
    g.backend().run(rows::SampleSums<T>{dZ, sums.data(), L, d}, B * d);
    g.backend().run(rows::PooledBlockApply<T>{blocks_.data(), sums.data(), dgZ, L, d}, B * L * d);
  }

 private:
  T w(index_t a, index_t c) const { return W_ ? W_[a * C_ + c] : (a == c ? T(1) : T(0)); }  // W_C[a, c], on the host

  const std::int64_t* classes_;
  const T* W_;
  const T* b_;
  index_t C_;
  BackendBuffer<T> p_;               // softmax(logits_b), (B, C)
  BackendBuffer<T> wp_;              // W_C p_b, (B, d)
  BackendBuffer<T> blocks_;          // G_b, (B, d, d)
};

}  // namespace blockhess::engine
