// Single-head self-attention of an input X that no parameter moves (the block's input):
//   Q = X W_Q, K = X W_K, V = X W_V,  T = s Q K^T (s = 1/sqrt(d_k)),  A = softmax_rows(T),  F = A V,
// per sample (docs/derivation.md §3.3). The one node that mixes tokens: its parameters' factors at
// F are formed here, in closed form, per token t (the table of docs/derivation.md §4.2):
//   W_Q: vec x_t (rows),      U_t = Mq_t = s V^T Jsm_t K      (d_v, d_k)
//   W_K: vec s q_t (columns), U_t = Mk_t = V^T Jsm_t X        (d_v, d)
//   W_V: vec (A X)_t (rows),  U_t = I
// with Jsm_t = diag(a_t) - a_t a_t^T. Its curvature: the softmax site at T (the logits row T_t
// moves by s K dW_Q^T x_t and by X dW_K s q_t), the bilinear <gF, dA dV> and <gT, s dQ dK^T>.
// With biases (Q = X W_Q + b_Q, ...): b_Q enters like W_Q with vec [1]; b_V like W_V with vec [1]
// (the rows of A sum to 1); b_K moves every logit of a row by the same q_t . db_K, which softmax
// ignores: its gradient and curvature are exactly 0. The terms with b_V vanish too (Jsm_t 1 = 0),
// and <gT, dQ dK^T> with b_K (the rows of gT sum to 0).
// Causal: T[t, s] = -inf for keys s after the query t. Then a_t[s] = 0 there, and so is every
// derivative (Jsm_t has zero rows and columns at masked keys): only the forward pass changes.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine {

template <class T>
class AttentionNode final : public Node<T> {
  using Vec = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;

 public:
  explicit AttentionNode(bool causal = false) : causal_(causal) {}

  void forward(Graph<T>& g) override {
    if (g.varies(x())) throw std::logic_error("engine: attention of an input that parameters move is not wired yet");
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    dk_ = g.parameter(wq()).cols;
    dv_ = g.width(this->output);
    s_ = T(1) / std::sqrt(static_cast<T>(dk_));
    Q_.resize(n * dk_), K_.resize(n * dk_), V_.resize(n * dv_), A_.resize(B * L * L);
    const MapC<T> X(g.value(x()), n, d);
    product(MapM<T>(Q_.data(), n, dk_), X, W(g, wq()), T(1), false);
    product(MapM<T>(K_.data(), n, dk_), X, W(g, wk()), T(1), false);
    product(MapM<T>(V_.data(), n, dv_), X, W(g, wv()), T(1), false);
    if (biased()) {
      MapM<T>(Q_.data(), n, dk_).rowwise() += MapC<T>(g.weight(bq()), 1, dk_).row(0);
      MapM<T>(K_.data(), n, dk_).rowwise() += MapC<T>(g.weight(bk()), 1, dk_).row(0);
      MapM<T>(V_.data(), n, dv_).rowwise() += MapC<T>(g.weight(bv()), 1, dv_).row(0);
    }
    require_finite(Q_.data(), n * dk_, "block: the queries X W_Q");
    require_finite(K_.data(), n * dk_, "block: the keys X W_K");
    require_finite(V_.data(), n * dv_, "block: the values X W_V");
    T* F = g.value_out(this->output);
    for (index_t b = 0; b < B; ++b) {
      MapM<T> A(A_.data() + b * L * L, L, L);
      product(A, sample(Q_, b, dk_, L), sample(K_, b, dk_, L).transpose(), s_, false);
      if (causal_)
        for (index_t i = 0; i < L; ++i) std::fill(A.data() + i * L + i + 1, A.data() + (i + 1) * L, -std::numeric_limits<T>::infinity());
      for (index_t i = 0; i < L; ++i) softmax::forward_row(A.data() + i * L, L, A.data() + i * L);
      product(MapM<T>(F + b * L * dv_, L, dv_), A, sample(V_, b, dv_, L), T(1), false);
    }
    require_finite(A_.data(), B * L * L, "block: the attention weights softmax(X W_Q W_K^T X^T / sqrt(d_k))");
    require_finite(F, n * dv_, "block: the attention output A X W_V");
  }

  // gA = gF V^T, gT = Jsm gA (row by row); the gradients s X^T gT K, s X^T gT^T Q, X^T A^T gF.
  void vjp(Graph<T>& g) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    gA_.resize(B * L * L), gT_.resize(B * L * L);
    for (index_t b = 0; b < B; ++b)
      product(MapM<T>(gA_.data() + b * L * L, L, L), MapC<T>(gF + b * L * dv_, L, dv_), sample(V_, b, dv_, L).transpose(),
              T(1), false);
    for (index_t t = 0; t < B * L; ++t) softmax::vjp_row(A_.data() + t * L, gA_.data() + t * L, L, gT_.data() + t * L);
    require_finite(gT_.data(), B * L * L, "block: the reverse pass through the attention weights");
    T *gQ = g.gradient_out(wq()), *gK = g.gradient_out(wk()), *gV = g.gradient_out(wv());
    if (gQ) MapM<T>(gQ, d, dk_).setZero();
    if (gK) MapM<T>(gK, d, dk_).setZero();
    if (gV) MapM<T>(gV, d, dv_).setZero();
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> X = sample_x(g, b), gT(gT_.data() + b * L * L, L, L), A(A_.data() + b * L * L, L, L);
      if (gQ) MapM<T>(gQ, d, dk_).noalias() += s_ * X.transpose() * (gT * sample(K_, b, dk_, L));
      if (gK) MapM<T>(gK, d, dk_).noalias() += s_ * X.transpose() * (gT.transpose() * sample(Q_, b, dk_, L));
      if (gV) MapM<T>(gV, d, dv_).noalias() += X.transpose() * (A.transpose() * MapC<T>(gF + b * L * dv_, L, dv_));
    }
    if (!biased()) return;
    T *gbQ = g.gradient_out(bq()), *gbK = g.gradient_out(bk()), *gbV = g.gradient_out(bv());
    if (gbQ) MapM<T>(gbQ, 1, dk_).setZero();
    if (gbK) MapM<T>(gbK, 1, dk_).setZero();  // exactly: the rows of gT sum to 0
    if (gbV) MapM<T>(gbV, 1, dv_).setZero();
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> gT(gT_.data() + b * L * L, L, L), A(A_.data() + b * L * L, L, L);
      if (gbQ) MapM<T>(gbQ, 1, dk_) += s_ * (gT * sample(K_, b, dk_, L)).colwise().sum();
      if (gbV) MapM<T>(gbV, 1, dv_) += (A.transpose() * MapC<T>(gF + b * L * dv_, L, dv_)).colwise().sum();
    }
  }

  void push(Graph<T>& g) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* F = g.value(this->output);
    const bool query_side = g.selected(wq()) || (biased() && g.selected(bq()));
    if (query_side || g.selected(wk())) {
      Buffer<T> Mq(query_side ? n * dv_ * dk_ : 0), Mk(g.selected(wk()) ? n * dv_ * d : 0);
      blockhess::detail::parallel_for(n, L * dv_ * (d + dk_), [&](index_t t) {
        const index_t b = t / L;
        const Vec a(A_.data() + t * L, L);
        const Mat<T> Va = a.asDiagonal() * sample(V_, b, dv_, L);  // rows a_s v_s
        const auto Ft = MapC<T>(F + t * dv_, 1, dv_);
        // The centred sums as differences of two products formed apart (Kbar, Xbar evaluated
        // first): where attention is one-hot both are equal and the difference is exactly 0.
        if (!Mq.empty()) {
          const Mat<T> Kbar = a.transpose() * sample(K_, b, dk_, L);
          MapM<T>(Mq.data() + t * dv_ * dk_, dv_, dk_).noalias() =
              s_ * (Va.transpose() * sample(K_, b, dk_, L) - Ft.transpose() * Kbar);
        }
        if (!Mk.empty()) {
          const Mat<T> Xbar = a.transpose() * sample_x(g, b);
          MapM<T>(Mk.data() + t * dv_ * d, dv_, d).noalias() = Va.transpose() * sample_x(g, b) - Ft.transpose() * Xbar;
        }
      });
      if (query_side) {
        const Factor<T> at_Q = moved(entering<T>(kron::Split{d, dk_, true}, g.value_buffer(x()), dk_), Form::dense, dv_,
                                     std::move(Mq));
        if (g.selected(wq())) g.set_factor(this->output, wq(), at_Q);
        if (biased() && g.selected(bq())) {
          Factor<T> bias = at_Q;  // the same U_t = Mq_t, with vec [1]
          bias.split = kron::Split{1, dk_, true};
          bias.vec = std::make_shared<const Buffer<T>>(n, T(1));
          g.set_factor(this->output, bq(), std::move(bias));
        }
      }
      if (g.selected(wk())) {
        Buffer<T> sq(n * dk_);
        for (index_t k = 0; k < n * dk_; ++k) sq[k] = s_ * Q_[k];
        Factor<T> f = entering<T>(kron::Split{d, dk_, false}, std::make_shared<const Buffer<T>>(std::move(sq)), d);
        g.set_factor(this->output, wk(), moved(f, Form::dense, dv_, std::move(Mk)));
      }
    }
    if (g.selected(wv())) {
      Buffer<T> AX(n * d);
      for (index_t b = 0; b < B; ++b)
        product(MapM<T>(AX.data() + b * L * d, L, d), MapC<T>(A_.data() + b * L * L, L, L), sample_x(g, b), T(1), false);
      g.set_factor(this->output, wv(), entering<T>(kron::Split{d, dv_, true}, std::make_shared<const Buffer<T>>(std::move(AX)), dv_));
    }
    if (biased() && g.selected(bv()))
      g.set_factor(this->output, bv(), entering<T>(kron::Split{1, dv_, true}, std::make_shared<const Buffer<T>>(n, T(1)), dv_));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    const index_t L = g.tokens_per_sample(), d = g.width(x());
    std::vector<int> logit_params{wq(), wk()};
    if (biased()) logit_params.insert(logit_params.begin() + 1, bq());
    // The logits row T_t moves by U_t^T-side matrices that are per sample: s K (W_Q, b_Q), X (W_K).
    auto logit_matrix = [this, &g, L](int p, index_t b) -> Mat<T> {
      if (p == wk()) return sample_x(g, b);
      return s_ * sample(K_, b, dk_, L);
    };
    // <gA, softmax''[dT, dT]>: the softmax site at T, with the logits' own factors.
    for (int i : logit_params)
      for (int j : logit_params) {
        if (j < i || !g.selected(i) || !g.selected(j)) continue;
        const Factor<T>&fi = g.factor(this->output, i), &fj = g.factor(this->output, j);
        terms.kron.push_back(KronTerm<T>{i, j, fi.split, fj.split, fi.vec->data(), fj.vec->data(),
                                         [this, logit_matrix, i, j, L](index_t t, T* out) {
                                           const index_t b = t / L;
                                           Mat<T> Hs(L, L);
                                           softmax::hessian_contract_row(A_.data() + t * L, gA_.data() + t * L, L, Hs.data());
                                           const Mat<T> Ui = logit_matrix(i, b), Uj = logit_matrix(j, b);
                                           MapM<T>(out, Ui.cols(), Uj.cols()).noalias() = Ui.transpose() * Hs * Uj;
                                         },
                                         i == j});
      }
    // <gF, dA dV> with dV = X dW_V: Gamma_t = U_t^T Jsm_t X, gF on W_V's columns.
    const T* gF = g.cotangent(this->output);
    if (g.selected(wv()))
      for (int i : logit_params) {
        if (!g.selected(i)) continue;
        const Factor<T>& fi = g.factor(this->output, i);
        terms.kron.push_back(KronTerm<T>{i, wv(), fi.split, kron::Split{d, dv_, false}, fi.vec->data(), gF,
                                         [this, &g, logit_matrix, i, L](index_t t, T* out) {
                                           const index_t b = t / L;
                                           const Vec a(A_.data() + t * L, L);
                                           const Mat<T> U = logit_matrix(i, b);
                                           const MapC<T> X = sample_x(g, b);
                                           // U^T Jsm_t X = U^T diag(a) X - (a^T U)^T (a^T X)
                                           MapM<T>(out, U.cols(), X.cols()).noalias() =
                                               U.transpose() * a.asDiagonal() * X - (a.transpose() * U).transpose() * (a.transpose() * X);
                                         },
                                         false});
      }
    // <gT, s dQ dK^T>: sum_t (x_t dW_Q + db_Q) . s (gT X)_t dW_K, diagonal in the key column.
    const bool with_bias_q = biased() && g.selected(bq());
    if ((g.selected(wq()) || with_bias_q) && g.selected(wk())) {
      const index_t B = g.samples(), n = g.tokens();
      Buffer<T> gTX(n * d);
      for (index_t b = 0; b < B; ++b)
        product(MapM<T>(gTX.data() + b * L * d, L, d), MapC<T>(gT_.data() + b * L * L, L, L), sample_x(g, b), s_, false);
      const T* gtx = terms.kept(std::move(gTX));
      const kron::Split by_rows{d, dk_, true};
      if (g.selected(wq())) terms.diagonal.push_back(DiagonalTerm<T>{wq(), wk(), by_rows, by_rows, g.value(x()), gtx, nullptr});
      if (with_bias_q)
        terms.diagonal.push_back(DiagonalTerm<T>{bq(), wk(), kron::Split{1, dk_, true}, by_rows, terms.kept(Buffer<T>(n, T(1))), gtx, nullptr});
    }
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T *dWQ = tg.dW[wq()], *dWK = tg.dW[wk()], *dWV = tg.dW[wv()];
    const T *dbQ = biased() ? tg.dW[bq()] : nullptr, *dbK = biased() ? tg.dW[bk()] : nullptr;
    const T* dbV = biased() ? tg.dW[bv()] : nullptr;
    if (!dWQ && !dWK && !dWV && !dbQ && !dbK && !dbV) return;
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const MapC<T> X(g.value(x()), n, d);
    // X dW + 1 db, zero where neither is selected.
    auto input_times = [&](int k, const T* dW, const T* db, index_t cols) -> const Buffer<T>& {
      Buffer<T>& out = tg.scratch(this->index, k, n * cols);
      MapM<T> o(out.data(), n, cols);
      if (dW) product(o, X, MapC<T>(dW, d, cols), T(1), false);
      else o.setZero();
      if (db) o.rowwise() += MapC<T>(db, 1, cols).row(0);
      return out;
    };
    const Buffer<T>&dQ = input_times(kDQ, dWQ, dbQ, dk_), &dK = input_times(kDK, dWK, dbK, dk_);
    const Buffer<T>& dV = input_times(kDV, dWV, dbV, dv_);
    Buffer<T>& dA = tg.scratch(this->index, kDA, B * L * L);
    MapM<T> dT(tg.scratch(this->index, kRows, L * L).data(), L, L);
    T* dF = tg.out(this->output, n * dv_);
    for (index_t b = 0; b < B; ++b) {
      product(dT, sample(dQ, b, dk_, L), sample(K_, b, dk_, L).transpose(), s_, false);
      product(dT, sample(Q_, b, dk_, L), sample(dK, b, dk_, L).transpose(), s_, true);
      const T* A = A_.data() + b * L * L;
      T* dAb = dA.data() + b * L * L;
      for (index_t i = 0; i < L; ++i) softmax::vjp_row(A + i * L, dT.data() + i * L, L, dAb + i * L);  // J symmetric
      const MapM<T> dFb(dF + b * L * dv_, L, dv_);
      product(dFb, MapC<T>(dAb, L, L), sample(V_, b, dv_, L), T(1), false);
      product(dFb, MapC<T>(A, L, L), sample(dV, b, dv_, L), T(1), true);
    }
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const T* dgF = tg.dcot[this->output].data();
    // Which inputs move: a weight or its bias (the tangents dQ, dK, dV of jvp hold both).
    const bool moves_q = tg.dW[wq()] || (biased() && tg.dW[bq()]), moves_k = tg.dW[wk()] || (biased() && tg.dW[bk()]);
    const bool moves_v = tg.dW[wv()] || (biased() && tg.dW[bv()]);
    const Buffer<T>&dQ = tg.scratch(this->index, kDQ, n * dk_), &dK = tg.scratch(this->index, kDK, n * dk_);
    const Buffer<T>&dV = tg.scratch(this->index, kDV, n * dv_), &dA = tg.scratch(this->index, kDA, B * L * L);
    Buffer<T>& dgT = tg.scratch(this->index, kDgT, B * L * L);
    const MapM<T> dgA(tg.scratch(this->index, kRows, L * L).data(), L, L);
    for (index_t b = 0; b < B; ++b) {
      product(dgA, MapC<T>(dgF + b * L * dv_, L, dv_), sample(V_, b, dv_, L).transpose(), T(1), false);
      if (curved && moves_v) product(dgA, MapC<T>(gF + b * L * dv_, L, dv_), sample(dV, b, dv_, L).transpose(), T(1), true);
      for (index_t i = 0; i < L; ++i) {
        const index_t row = b * L * L + i * L;
        if (curved) softmax::vjp_tangent_row(A_.data() + row, dA.data() + row, gA_.data() + row, dgA.data() + i * L, L, dgT.data() + row);
        else softmax::vjp_row(A_.data() + row, dgA.data() + i * L, L, dgT.data() + row);
      }
    }
    // Each weight's gradient, differentiated by the product rule.
    T *oQ = tg.dgrad[wq()], *oK = tg.dgrad[wk()], *oV = tg.dgrad[wv()];
    T *obQ = biased() ? tg.dgrad[bq()] : nullptr, *obK = biased() ? tg.dgrad[bk()] : nullptr;
    T* obV = biased() ? tg.dgrad[bv()] : nullptr;
    if (oQ) MapM<T>(oQ, d, dk_).setZero();
    if (oK) MapM<T>(oK, d, dk_).setZero();
    if (oV) MapM<T>(oV, d, dv_).setZero();
    if (obQ) MapM<T>(obQ, 1, dk_).setZero();
    if (obK) MapM<T>(obK, 1, dk_).setZero();  // b_K moves nothing: its rows of H v are exactly 0
    if (obV) MapM<T>(obV, 1, dv_).setZero();
    const MapM<T> iq(tg.scratch(this->index, kInnerQ, L * dk_).data(), L, dk_);
    const MapM<T> ik(tg.scratch(this->index, kInnerK, L * dk_).data(), L, dk_);
    const MapM<T> iv(tg.scratch(this->index, kInnerV, L * dv_).data(), L, dv_);
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> X = sample_x(g, b), gT(gT_.data() + b * L * L, L, L), dgTb(dgT.data() + b * L * L, L, L);
      const MapC<T> A(A_.data() + b * L * L, L, L), dAb(dA.data() + b * L * L, L, L);
      if (oQ || obQ) {
        product(iq, dgTb, sample(K_, b, dk_, L), T(1), false);
        if (curved && moves_k) product(iq, gT, sample(dK, b, dk_, L), T(1), true);
        if (oQ) product(MapM<T>(oQ, d, dk_), X.transpose(), iq, s_, true);
        if (obQ) MapM<T>(obQ, 1, dk_) += s_ * iq.colwise().sum();
      }
      if (oK) {
        product(ik, dgTb.transpose(), sample(Q_, b, dk_, L), T(1), false);
        if (curved && moves_q) product(ik, gT.transpose(), sample(dQ, b, dk_, L), T(1), true);
        product(MapM<T>(oK, d, dk_), X.transpose(), ik, s_, true);
      }
      if (oV || obV) {
        product(iv, A.transpose(), MapC<T>(dgF + b * L * dv_, L, dv_), T(1), false);
        if (curved) product(iv, dAb.transpose(), MapC<T>(gF + b * L * dv_, L, dv_), T(1), true);
        if (oV) product(MapM<T>(oV, d, dv_), X.transpose(), iv, T(1), true);
        if (obV) MapM<T>(obV, 1, dv_) += iv.colwise().sum();
      }
    }
  }

  const Buffer<T>& attention_weights() const { return A_; }

 private:
  // Per-product scratch slots in a Tangent.
  enum : int { kDQ, kDK, kDV, kDA, kRows, kDgT, kInnerQ, kInnerK, kInnerV };

  // Parameters in the canonical order: W_Q, W_K, W_V, or W_Q, b_Q, W_K, b_K, W_V, b_V.
  bool biased() const { return this->params.size() == 6; }
  int x() const { return this->inputs[0]; }
  int wq() const { return this->params[0]; }
  int bq() const { return this->params[1]; }
  int wk() const { return this->params[biased() ? 2 : 1]; }
  int bk() const { return this->params[3]; }
  int wv() const { return this->params[biased() ? 4 : 2]; }
  int bv() const { return this->params[5]; }
  MapC<T> W(const Graph<T>& g, int p) const {
    return MapC<T>(g.weight(p), g.parameter(p).rows, g.parameter(p).cols);
  }
  static MapC<T> sample(const Buffer<T>& rows, index_t b, index_t width, index_t L) {
    return MapC<T>(rows.data() + b * L * width, L, width);
  }
  MapC<T> sample_x(const Graph<T>& g, index_t b) const {
    const index_t L = g.tokens_per_sample(), d = g.width(x());
    return MapC<T>(g.value(x()) + b * L * d, L, d);
  }

  bool causal_;
  index_t dk_ = 0, dv_ = 0;
  T s_ = 0;
  Buffer<T> Q_, K_, V_, A_;
  mutable Buffer<T> gA_, gT_;  // the reverse pass's (vjp), read by curvature and vjp_tangent
};

}  // namespace blockhess::engine
