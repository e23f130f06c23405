// Multi-head self-attention of an input X that no parameter moves (the block's input, or a norm of
// it without trainable parameters): with h heads and s = 1/sqrt(d_k),
//   Q = X W_Q (+ b_Q), K = X W_K (+ b_K), V = X W_V (+ b_V)   (h d_k, h d_k and h d_v columns);
//   head i: T_i = s Q_i K_i^T, A_i = softmax_rows(T_i), F_i = A_i V_i, on its own columns;
//   F = [F_1 ... F_h] (L, h d_v), per sample (docs/derivation.md §3.3).
// The one node that mixes tokens: its parameters' factors at F are formed here, in closed form, per
// token t and head i, each head's columns of a weight as its own piece (Graph::split_columns):
//   W_Q: vec x_t (rows),        U_t = Mq_t = s V_i^T Jsm_t K_i  on head i's rows of F (d_v, d_k)
//   W_K: vec s q_t (columns),   U_t = Mk_t = V_i^T Jsm_t X      on head i's rows      (d_v, d)
//   W_V: vec (A_i X)_t (rows),  U_t = I                          on head i's rows
// with Jsm_t = diag(a_t) - a_t a_t^T for row t of A_i. Its curvature, head by head: the softmax site
// at T_i (the logits row moves by s K_i dW_Q^T x_t and by X dW_K s q_t), the bilinear
// <gF_i, dA_i dV_i> and <gT_i, s dQ_i dK_i^T>; heads do not meet inside the node.
// With biases: b_Q enters like W_Q with vec [1]; b_V like W_V with vec [1] (the rows of A sum to
// 1); b_K moves every logit of a row by the same q_t . db_K, which softmax ignores: its gradient
// and curvature are exactly 0. The terms with b_V vanish too (Jsm_t 1 = 0), and <gT, dQ dK^T> with
// b_K (the rows of gT sum to 0).
// Causal: T[t, s] = -inf for keys s after the query t. Then a_t[s] = 0 there, and so is every
// derivative (Jsm_t has zero rows and columns at masked keys): only the forward pass changes.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
  explicit AttentionNode(bool causal = false, index_t heads = 1) : causal_(causal), heads_(heads) {}

  void forward(Graph<T>& g) override {
    if (g.varies(x())) throw std::logic_error("engine: attention of an input that parameters move is not wired yet");
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    hk_ = g.parameter(wq()).cols;
    hv_ = g.width(this->output);
    dk_ = hk_ / heads_;
    dv_ = hv_ / heads_;
    if (dk_ * heads_ != hk_ || dv_ * heads_ != hv_)
      throw std::invalid_argument("attention: the query and value widths must be multiples of the number of heads");
    s_ = T(1) / std::sqrt(static_cast<T>(dk_));
    if (heads_ > 1)
      for (int p : {wq(), wk(), wv()}) g.split_columns(p, heads_);
    if (heads_ > 1 && biased())
      for (int p : {bq(), bk(), bv()}) g.split_columns(p, heads_);
    Q_.resize(n * hk_), K_.resize(n * hk_), V_.resize(n * hv_), A_.resize(B * heads_ * L * L);
    const MapC<T> X(g.value(x()), n, d);
    product(MapM<T>(Q_.data(), n, hk_), X, W(g, wq()), T(1), false);
    product(MapM<T>(K_.data(), n, hk_), X, W(g, wk()), T(1), false);
    product(MapM<T>(V_.data(), n, hv_), X, W(g, wv()), T(1), false);
    if (biased()) {
      MapM<T>(Q_.data(), n, hk_).rowwise() += MapC<T>(g.weight(bq()), 1, hk_).row(0);
      MapM<T>(K_.data(), n, hk_).rowwise() += MapC<T>(g.weight(bk()), 1, hk_).row(0);
      MapM<T>(V_.data(), n, hv_).rowwise() += MapC<T>(g.weight(bv()), 1, hv_).row(0);
    }
    require_finite(Q_.data(), n * hk_, "block: the queries X W_Q");
    require_finite(K_.data(), n * hk_, "block: the keys X W_K");
    require_finite(V_.data(), n * hv_, "block: the values X W_V");
    T* F = g.value_out(this->output);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        MapM<T> A(weights(b, i, L), L, L);
        product(A, q(b, i, L), k(b, i, L).transpose(), s_, false);
        if (causal_)
          for (index_t r = 0; r < L; ++r)
            std::fill(A.data() + r * L + r + 1, A.data() + (r + 1) * L, -std::numeric_limits<T>::infinity());
        for (index_t r = 0; r < L; ++r) softmax::forward_row(A.data() + r * L, L, A.data() + r * L);
        product(head_cols(F, b, i, L), A, v(b, i, L), T(1), false);
      }
    require_finite(A_.data(), B * heads_ * L * L, "block: the attention weights softmax(X W_Q W_K^T X^T / sqrt(d_k))");
    require_finite(F, n * hv_, "block: the attention output A X W_V");
  }

  // gA = gF V^T, gT = Jsm gA (row by row), head by head; the gradients s X^T gT K, s X^T gT^T Q,
  // X^T A^T gF on each head's columns.
  void vjp(Graph<T>& g) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    gA_.resize(A_.size()), gT_.resize(A_.size());
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        T* gA = gA_.data() + (b * heads_ + i) * L * L;
        product(MapM<T>(gA, L, L), head_cols(gF, b, i, L), v(b, i, L).transpose(), T(1), false);
        for (index_t r = 0; r < L; ++r)
          softmax::vjp_row(weights(b, i, L) + r * L, gA + r * L, L, gT_.data() + (b * heads_ + i) * L * L + r * L);
      }
    require_finite(gT_.data(), static_cast<index_t>(gT_.size()), "block: the reverse pass through the attention weights");
    T *gQ = g.gradient_out(wq()), *gK = g.gradient_out(wk()), *gV = g.gradient_out(wv());
    T *gbQ = biased() ? g.gradient_out(bq()) : nullptr, *gbV = biased() ? g.gradient_out(bv()) : nullptr;
    if (gQ) MapM<T>(gQ, d, hk_).setZero();
    if (gK) MapM<T>(gK, d, hk_).setZero();
    if (gV) MapM<T>(gV, d, hv_).setZero();
    if (gbQ) MapM<T>(gbQ, 1, hk_).setZero();
    if (gbV) MapM<T>(gbV, 1, hv_).setZero();
    if (biased())
      if (T* gbK = g.gradient_out(bk())) MapM<T>(gbK, 1, hk_).setZero();  // exactly: the rows of gT sum to 0
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        const MapC<T> X = sample_x(g, b), gT(logit_cotangent(b, i, L), L, L), A(weights(b, i, L), L, L);
        const auto gFi = head_cols(gF, b, i, L);
        if (gQ || gbQ) {
          const Mat<T> inner = s_ * (gT * k(b, i, L));
          if (gQ) MapM<T>(gQ, d, hk_).middleCols(i * dk_, dk_).noalias() += X.transpose() * inner;
          if (gbQ) MapM<T>(gbQ, 1, hk_).middleCols(i * dk_, dk_) += inner.colwise().sum();
        }
        if (gK) MapM<T>(gK, d, hk_).middleCols(i * dk_, dk_).noalias() += s_ * X.transpose() * (gT.transpose() * q(b, i, L));
        if (gV || gbV) {
          const Mat<T> inner = A.transpose() * gFi;
          if (gV) MapM<T>(gV, d, hv_).middleCols(i * dv_, dv_).noalias() += X.transpose() * inner;
          if (gbV) MapM<T>(gbV, 1, hv_).middleCols(i * dv_, dv_) += inner.colwise().sum();
        }
      }
  }

  void push(Graph<T>& g) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* F = g.value(this->output);
    auto ones = std::make_shared<const Buffer<T>>(n, T(1));
    for (index_t i = 0; i < heads_; ++i) {
      const bool query_side = g.selected(wq()) || (biased() && g.selected(bq()));
      if (query_side || g.selected(wk())) {
        // Mq_t, Mk_t on head i's rows of F (zero elsewhere).
        Buffer<T> Mq(query_side ? n * hv_ * dk_ : 0, T(0)), Mk(g.selected(wk()) ? n * hv_ * d : 0, T(0));
        blockhess::detail::parallel_for(n, L * dv_ * (d + dk_), [&](index_t t) {
          const index_t b = t / L, r = t % L;
          const Vec a(weights(b, i, L) + r * L, L);
          const Mat<T> Va = a.asDiagonal() * v(b, i, L);  // rows a_s v_s
          const auto Ft = MapC<T>(F + t * hv_ + i * dv_, 1, dv_);
          // The centred sums as differences of two products formed apart (Kbar, Xbar evaluated
          // first): where attention is one-hot both are equal and the difference is exactly 0.
          if (!Mq.empty()) {
            const Mat<T> Kbar = a.transpose() * k(b, i, L);
            MapM<T>(Mq.data() + t * hv_ * dk_, hv_, dk_).middleRows(i * dv_, dv_).noalias() =
                s_ * (Va.transpose() * k(b, i, L) - Ft.transpose() * Kbar);
          }
          if (!Mk.empty()) {
            const Mat<T> Xbar = a.transpose() * sample_x(g, b);
            MapM<T>(Mk.data() + t * hv_ * d, hv_, d).middleRows(i * dv_, dv_).noalias() =
                Va.transpose() * sample_x(g, b) - Ft.transpose() * Xbar;
          }
        });
        if (query_side) {
          Factor<T> at_Q;
          at_Q.present = true, at_Q.form = Form::dense, at_Q.width = hv_;
          at_Q.U = std::make_shared<const Buffer<T>>(std::move(Mq));
          if (g.selected(wq())) {
            const int piece = g.pieces_of(wq())[i];
            at_Q.split = g.split_of(piece, true);
            at_Q.vec = g.value_buffer(x());
            g.set_factor(this->output, piece, at_Q);
          }
          if (biased() && g.selected(bq())) {  // the same U_t, with vec [1]
            const int piece = g.pieces_of(bq())[i];
            at_Q.split = g.split_of(piece, true);
            at_Q.vec = ones;
            g.set_factor(this->output, piece, at_Q);
          }
        }
        if (g.selected(wk())) {
          Buffer<T> sq(n * dk_);
          for (index_t t = 0; t < n; ++t)
            for (index_t c = 0; c < dk_; ++c) sq[t * dk_ + c] = s_ * Q_[t * hk_ + i * dk_ + c];
          Factor<T> f;
          f.present = true, f.form = Form::dense, f.width = hv_;
          f.split = g.split_of(g.pieces_of(wk())[i], false);
          f.vec = std::make_shared<const Buffer<T>>(std::move(sq));
          f.U = std::make_shared<const Buffer<T>>(std::move(Mk));
          g.set_factor(this->output, g.pieces_of(wk())[i], std::move(f));
        }
      }
      const bool values = g.selected(wv()) || (biased() && g.selected(bv()));
      if (!values) continue;
      // U_t = I on head i's rows: the identity form with one head.
      Factor<T> at_V;
      at_V.present = true, at_V.width = hv_;
      if (heads_ == 1) {
        at_V.form = Form::identity;
      } else {
        Buffer<T> U(n * hv_ * dv_, T(0));
        for (index_t t = 0; t < n; ++t)
          for (index_t c = 0; c < dv_; ++c) U[(t * hv_ + i * dv_ + c) * dv_ + c] = T(1);
        at_V.form = Form::dense;
        at_V.U = std::make_shared<const Buffer<T>>(std::move(U));
      }
      if (g.selected(wv())) {
        Buffer<T> AX(n * d);
        for (index_t b = 0; b < B; ++b)
          product(MapM<T>(AX.data() + b * L * d, L, d), MapC<T>(weights(b, i, L), L, L), sample_x(g, b), T(1), false);
        const int piece = g.pieces_of(wv())[i];
        at_V.split = g.split_of(piece, true);
        at_V.vec = std::make_shared<const Buffer<T>>(std::move(AX));
        g.set_factor(this->output, piece, at_V);
      }
      if (biased() && g.selected(bv())) {
        const int piece = g.pieces_of(bv())[i];
        at_V.split = g.split_of(piece, true);
        at_V.vec = ones;
        g.set_factor(this->output, piece, at_V);
      }
    }
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const T* ones = terms.kept(Buffer<T>(n, T(1)));
    for (index_t i = 0; i < heads_; ++i) {
      // The logits row of head i moves by s K_i (W_Q, b_Q) or by X (W_K) on the matrix side.
      std::vector<int> logit_pieces;
      for (int p : {wq(), biased() ? bq() : -1, wk()})
        if (p >= 0 && g.selected(p)) logit_pieces.push_back(g.pieces_of(p)[i]);
      const int key_piece = g.pieces_of(wk())[i];
      auto logit_matrix = [this, &g, L, i, key_piece](int piece, index_t b) -> Mat<T> {
        if (piece == key_piece) return sample_x(g, b);
        return s_ * k(b, i, L);
      };
      // <gA_i, softmax''[dT_i, dT_i]>: the softmax site at T_i, with the logits' own factors.
      for (size_t a = 0; a < logit_pieces.size(); ++a)
        for (size_t c = a; c < logit_pieces.size(); ++c) {
          const int pi = logit_pieces[a], pj = logit_pieces[c];
          const Factor<T>&fi = g.factor(this->output, pi), &fj = g.factor(this->output, pj);
          terms.kron.push_back(KronTerm<T>{pi, pj, fi.split, fj.split, fi.vec->data(), fj.vec->data(),
                                           [this, logit_matrix, pi, pj, L, i](index_t t, T* out) {
                                             const index_t b = t / L, r = t % L;
                                             Mat<T> Hs(L, L);
                                             softmax::hessian_contract_row(weights(b, i, L) + r * L,
                                                                           logit_cotangent_of_weights(b, i, L) + r * L, L,
                                                                           Hs.data());
                                             const Mat<T> Ui = logit_matrix(pi, b), Uj = logit_matrix(pj, b);
                                             MapM<T>(out, Ui.cols(), Uj.cols()).noalias() = Ui.transpose() * Hs * Uj;
                                           },
                                           pi == pj});
        }
      // <gF_i, dA_i dV_i> with dV_i = X dW_V (head i's columns): Gamma_t = U_t^T Jsm_t X, gF_i on W_V's columns.
      if (g.selected(wv())) {
        const int value_piece = g.pieces_of(wv())[i];
        Buffer<T> gFi(n * dv_);
        for (index_t t = 0; t < n; ++t) std::copy_n(gF + t * hv_ + i * dv_, dv_, gFi.data() + t * dv_);
        const T* gfi = terms.kept(std::move(gFi));
        for (int pi : logit_pieces) {
          const Factor<T>& fi = g.factor(this->output, pi);
          terms.kron.push_back(KronTerm<T>{pi, value_piece, fi.split, g.split_of(value_piece, false), fi.vec->data(), gfi,
                                           [this, &g, logit_matrix, pi, L, i](index_t t, T* out) {
                                             const index_t b = t / L, r = t % L;
                                             const Vec a(weights(b, i, L) + r * L, L);
                                             const Mat<T> U = logit_matrix(pi, b);
                                             const MapC<T> X = sample_x(g, b);
                                             // U^T Jsm_t X = U^T diag(a) X - (a^T U)^T (a^T X)
                                             MapM<T>(out, U.cols(), X.cols()).noalias() =
                                                 U.transpose() * a.asDiagonal() * X -
                                                 (a.transpose() * U).transpose() * (a.transpose() * X);
                                           },
                                           false});
        }
      }
      // <gT_i, s dQ_i dK_i^T>: sum_t (x_t dW_Q + db_Q) . s (gT_i X)_t dW_K, diagonal in the key column.
      const bool with_bias_q = biased() && g.selected(bq());
      if ((g.selected(wq()) || with_bias_q) && g.selected(wk())) {
        Buffer<T> gTX(n * d);
        for (index_t b = 0; b < B; ++b)
          product(MapM<T>(gTX.data() + b * L * d, L, d), MapC<T>(logit_cotangent(b, i, L), L, L), sample_x(g, b), s_,
                  false);
        const T* gtx = terms.kept(std::move(gTX));
        const kron::Split key_rows = g.split_of(key_piece, true);
        if (g.selected(wq())) {
          const int piece = g.pieces_of(wq())[i];
          terms.diagonal.push_back(DiagonalTerm<T>{piece, key_piece, g.split_of(piece, true), key_rows, g.value(x()), gtx, nullptr});
        }
        if (with_bias_q) {
          const int piece = g.pieces_of(bq())[i];
          terms.diagonal.push_back(DiagonalTerm<T>{piece, key_piece, g.split_of(piece, true), key_rows, ones, gtx, nullptr});
        }
      }
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
    auto input_times = [&](int slot, const T* dW, const T* db, index_t cols) -> const Buffer<T>& {
      Buffer<T>& out = tg.scratch(this->index, slot, n * cols);
      MapM<T> o(out.data(), n, cols);
      if (dW) product(o, X, MapC<T>(dW, d, cols), T(1), false);
      else o.setZero();
      if (db) o.rowwise() += MapC<T>(db, 1, cols).row(0);
      return out;
    };
    const Buffer<T>&dQ = input_times(kDQ, dWQ, dbQ, hk_), &dK = input_times(kDK, dWK, dbK, hk_);
    const Buffer<T>& dV = input_times(kDV, dWV, dbV, hv_);
    Buffer<T>& dA = tg.scratch(this->index, kDA, static_cast<index_t>(A_.size()));
    MapM<T> dT(tg.scratch(this->index, kRows, L * L).data(), L, L);
    T* dF = tg.out(this->output, n * hv_);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        product(dT, head(dQ, b, i, L, hk_, dk_), k(b, i, L).transpose(), s_, false);
        product(dT, q(b, i, L), head(dK, b, i, L, hk_, dk_).transpose(), s_, true);
        const T* A = weights(b, i, L);
        T* dAi = dA.data() + (b * heads_ + i) * L * L;
        for (index_t r = 0; r < L; ++r) softmax::vjp_row(A + r * L, dT.data() + r * L, L, dAi + r * L);  // J symmetric
        const auto dFi = head_cols(dF, b, i, L);
        product(dFi, MapC<T>(dAi, L, L), v(b, i, L), T(1), false);
        product(dFi, MapC<T>(A, L, L), head(dV, b, i, L, hv_, dv_), T(1), true);
      }
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const T* dgF = tg.dcot[this->output].data();
    // Which inputs move: a weight or its bias (the tangents dQ, dK, dV of jvp hold both).
    const bool moves_q = tg.dW[wq()] || (biased() && tg.dW[bq()]), moves_k = tg.dW[wk()] || (biased() && tg.dW[bk()]);
    const bool moves_v = tg.dW[wv()] || (biased() && tg.dW[bv()]);
    const index_t nA = static_cast<index_t>(A_.size());
    const Buffer<T>&dQ = tg.scratch(this->index, kDQ, n * hk_), &dK = tg.scratch(this->index, kDK, n * hk_);
    const Buffer<T>&dV = tg.scratch(this->index, kDV, n * hv_), &dA = tg.scratch(this->index, kDA, nA);
    Buffer<T>& dgT = tg.scratch(this->index, kDgT, nA);
    const MapM<T> dgA(tg.scratch(this->index, kRows, L * L).data(), L, L);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        product(dgA, head_cols(dgF, b, i, L), v(b, i, L).transpose(), T(1), false);
        if (curved && moves_v) product(dgA, head_cols(gF, b, i, L), head(dV, b, i, L, hv_, dv_).transpose(), T(1), true);
        const index_t at = (b * heads_ + i) * L * L;
        for (index_t r = 0; r < L; ++r) {
          const index_t row = at + r * L;
          if (curved) softmax::vjp_tangent_row(A_.data() + row, dA.data() + row, gA_.data() + row, dgA.data() + r * L, L, dgT.data() + row);
          else softmax::vjp_row(A_.data() + row, dgA.data() + r * L, L, dgT.data() + row);
        }
      }
    // Each weight's gradient, differentiated by the product rule.
    T *oQ = tg.dgrad[wq()], *oK = tg.dgrad[wk()], *oV = tg.dgrad[wv()];
    T *obQ = biased() ? tg.dgrad[bq()] : nullptr, *obV = biased() ? tg.dgrad[bv()] : nullptr;
    if (oQ) MapM<T>(oQ, d, hk_).setZero();
    if (oK) MapM<T>(oK, d, hk_).setZero();
    if (oV) MapM<T>(oV, d, hv_).setZero();
    if (obQ) MapM<T>(obQ, 1, hk_).setZero();
    if (obV) MapM<T>(obV, 1, hv_).setZero();
    if (biased())
      if (T* obK = tg.dgrad[bk()]) MapM<T>(obK, 1, hk_).setZero();  // b_K moves nothing: its rows of H v are exactly 0
    const MapM<T> iq(tg.scratch(this->index, kInnerQ, L * dk_).data(), L, dk_);
    const MapM<T> ik(tg.scratch(this->index, kInnerK, L * dk_).data(), L, dk_);
    const MapM<T> iv(tg.scratch(this->index, kInnerV, L * dv_).data(), L, dv_);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        const index_t at = (b * heads_ + i) * L * L;
        const MapC<T> X = sample_x(g, b), gT(gT_.data() + at, L, L), dgTi(dgT.data() + at, L, L);
        const MapC<T> A(A_.data() + at, L, L), dAi(dA.data() + at, L, L);
        if (oQ || obQ) {
          product(iq, dgTi, k(b, i, L), T(1), false);
          if (curved && moves_k) product(iq, gT, head(dK, b, i, L, hk_, dk_), T(1), true);
          if (oQ) product(MapM<T>(oQ, d, hk_).middleCols(i * dk_, dk_), X.transpose(), iq, s_, true);
          if (obQ) MapM<T>(obQ, 1, hk_).middleCols(i * dk_, dk_) += s_ * iq.colwise().sum();
        }
        if (oK) {
          product(ik, dgTi.transpose(), q(b, i, L), T(1), false);
          if (curved && moves_q) product(ik, gT.transpose(), head(dQ, b, i, L, hk_, dk_), T(1), true);
          product(MapM<T>(oK, d, hk_).middleCols(i * dk_, dk_), X.transpose(), ik, s_, true);
        }
        if (oV || obV) {
          product(iv, A.transpose(), head_cols(dgF, b, i, L), T(1), false);
          if (curved) product(iv, dAi.transpose(), head_cols(gF, b, i, L), T(1), true);
          if (oV) product(MapM<T>(oV, d, hv_).middleCols(i * dv_, dv_), X.transpose(), iv, T(1), true);
          if (obV) MapM<T>(obV, 1, hv_).middleCols(i * dv_, dv_) += iv.colwise().sum();
        }
      }
  }

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
  MapC<T> W(const Graph<T>& g, int p) const { return MapC<T>(g.weight(p), g.parameter(p).rows, g.parameter(p).cols); }

  // Head i's columns of sample b of a token-major array with `width` columns.
  static auto head(const Buffer<T>& rows, index_t b, index_t i, index_t L, index_t width, index_t cols) {
    return MapC<T>(rows.data() + b * L * width, L, width).middleCols(i * cols, cols);
  }
  auto q(index_t b, index_t i, index_t L) const { return head(Q_, b, i, L, hk_, dk_); }
  auto k(index_t b, index_t i, index_t L) const { return head(K_, b, i, L, hk_, dk_); }
  auto v(index_t b, index_t i, index_t L) const { return head(V_, b, i, L, hv_, dv_); }
  auto head_cols(T* F, index_t b, index_t i, index_t L) const {
    return MapM<T>(F + b * L * hv_, L, hv_).middleCols(i * dv_, dv_);
  }
  auto head_cols(const T* F, index_t b, index_t i, index_t L) const {
    return MapC<T>(F + b * L * hv_, L, hv_).middleCols(i * dv_, dv_);
  }
  // A_i of sample b, (L, L); its cotangent gT and gA.
  T* weights(index_t b, index_t i, index_t L) { return A_.data() + (b * heads_ + i) * L * L; }
  const T* weights(index_t b, index_t i, index_t L) const { return A_.data() + (b * heads_ + i) * L * L; }
  const T* logit_cotangent(index_t b, index_t i, index_t L) const { return gT_.data() + (b * heads_ + i) * L * L; }
  const T* logit_cotangent_of_weights(index_t b, index_t i, index_t L) const { return gA_.data() + (b * heads_ + i) * L * L; }
  MapC<T> sample_x(const Graph<T>& g, index_t b) const {
    const index_t L = g.tokens_per_sample(), d = g.width(x());
    return MapC<T>(g.value(x()) + b * L * d, L, d);
  }

  bool causal_;
  index_t heads_;
  index_t hk_ = 0, hv_ = 0, dk_ = 0, dv_ = 0;
  T s_ = 0;
  Buffer<T> Q_, K_, V_, A_;     // A: (B, heads, L, L)
  mutable Buffer<T> gA_, gT_;  // the reverse pass's (vjp), read by curvature and vjp_tangent
};

}  // namespace blockhess::engine
