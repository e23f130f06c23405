// Multi-head self-attention of an input X that no parameter moves (the block's input, or a norm of
// it without trainable parameters): with h heads and s = 1/sqrt(d_k),
//   Q = X W_Q (+ b_Q), K = X W_K (+ b_K), V = X W_V (+ b_V)   (h d_k, h d_k and h d_v columns);
//   head i: T_i = s Q_i K_i^T, A_i = softmax_rows(T_i), F_i = A_i V_i, on its own columns;
//   F = [F_1 ... F_h] (L, h d_v), per sample (docs/derivation.md §3.3).
// The one node that mixes tokens: its parameters' factors at F are formed here, in closed form, per
// token t and head i, each head's columns of a weight as its own piece (Graph::split_columns):
//   W_Q: vec x_t (rows),        R_t = Mq_t = s V_i^T Jsm_t K_i  (d_v, d_k)
//   W_K: vec s q_t (columns),   R_t = Mk_t = V_i^T Jsm_t X      (d_v, d)
//   W_V: vec (A_i X)_t (rows),  R_t = I
// with Jsm_t = diag(a_t) - a_t a_t^T for row t of A_i, all as U_t = G_t R_t with G_t head i's rows
// of the identity (factor.hpp): what moves downstream is one G_t per head, shared by the head's
// parameters, so W_K costs no more to push than W_V. Its curvature, head by head: the softmax site
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
#include <stdexcept>
#include <vector>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/engine/rows/attention.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/rows/heads.hpp"
#include "blockhess/engine/rows/softmax.hpp"
#include "blockhess/parallel_product.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::engine {

template <class T>
class AttentionNode final : public Node<T> {
  using Vec = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;

 public:
  explicit AttentionNode(bool causal = false, index_t heads = 1) : causal_(causal), heads_(heads) {}

  void forward(Graph<T>& g) override {
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
    Q_.resize(g.backend(), n * hk_), K_.resize(g.backend(), n * hk_), V_.resize(g.backend(), n * hv_);
    A_.resize(g.backend(), B * heads_ * L * L);
    const MapC<T> X(g.value(x()), n, d);
    product(g.backend(), MapM<T>(Q_.data(), n, hk_), X, W(g, wq()), T(1), false);
    product(g.backend(), MapM<T>(K_.data(), n, hk_), X, W(g, wk()), T(1), false);
    product(g.backend(), MapM<T>(V_.data(), n, hv_), X, W(g, wv()), T(1), false);
    if (biased()) {
      g.backend().run(rows::AddBias<T>{g.weight(bq()), Q_.data(), hk_}, n * hk_);
      g.backend().run(rows::AddBias<T>{g.weight(bk()), K_.data(), hk_}, n * hk_);
      g.backend().run(rows::AddBias<T>{g.weight(bv()), V_.data(), hv_}, n * hv_);
    }
    require_finite(g.backend(), Q_.data(), n * hk_, "block: the queries X W_Q");
    require_finite(g.backend(), K_.data(), n * hk_, "block: the keys X W_K");
    require_finite(g.backend(), V_.data(), n * hv_, "block: the values X W_V");
    T* F = g.value_out(this->output);
    // The logits of every head (a batch a sample), their rows' softmax, the outputs.
    for (index_t b = 0; b < B; ++b)
      batched_product(g.backend(), heads_, MapM<T>(weights(b, 0, L), L, L), L * L, q(b, 0, L), dk_,
                      k(b, 0, L).transpose(), dk_, s_, false);
    g.backend().run(rows::SoftmaxRows<T>{A_.data(), L, causal_}, B * heads_ * L);
    for (index_t b = 0; b < B; ++b)
      batched_product(g.backend(), heads_, head_cols(F, b, 0, L), dv_, MapC<T>(weights(b, 0, L), L, L), L * L,
                      v(b, 0, L), dv_, T(1), false);
    require_finite(g.backend(), A_.data(), B * heads_ * L * L, "block: the attention weights softmax(X W_Q W_K^T X^T / sqrt(d_k))");
    require_finite(g.backend(), F, n * hv_, "block: the attention output A X W_V");
  }

  // forward: Q, K, V and every head's weights A; vjp: gA, gT, gQ, gK, gV; a product: dQ, dK, dV,
  // dA and their cotangents' tangents, two (L, L) rows; curvature: the cotangent rows it keeps.
  Footprint footprint(const Graph<T>& g) const override {
    const index_t n = g.tokens(), L = g.tokens_per_sample(), hk = g.parameter(wq()).cols, hv = g.width(this->output);
    const index_t rows = n * (2 * hk + hv), weights = g.samples() * heads_ * L * L;
    return {rows + weights, rows + 2 * weights, 2 * rows + weights + 2 * L * L, n * (1 + hv + heads_ * g.width(x()))};
  }
  // Every parameter moves its head's rows of F: one (h d_v, d_v) G_t per head (push()); W_Q and W_K
  // bring their R_t (and right_factors()' rows of a chunk of tokens while it forms them), W_K its
  // scaled queries, W_V its A X rows.
  index_t factor_columns(const Graph<T>& g) const override { return g.width(this->output); }
  index_t entering_factor(const Graph<T>& g, int p) const override {
    const index_t n = g.tokens(), L = g.tokens_per_sample(), d = g.width(x()), hv = g.width(this->output);
    const index_t dk = g.parameter(wq()).cols / heads_, dv = hv / heads_;
    const index_t chunk = right_factor_chunk(L, dk) * (L * dv + std::max(d, dk));
    if (p == wq()) return n * hv * dk + chunk;
    if (p == wk()) return n * (hv * d + dk * heads_) + chunk;
    if (p == wv()) return n * heads_ * g.width(x());
    return n;
  }
  // mix(): the products with W_Q, W_K and W_V and each head's logit tangents, kept; while it runs,
  // Jsm_t dT_t of one sample's head.
  index_t passing_factor(const Graph<T>& g, index_t r) const override {
    const index_t n = g.tokens(), hv = g.width(this->output), hk = g.parameter(wq()).cols;
    return n * r * (2 * hk + hv + heads_ * g.tokens_per_sample());
  }
  index_t push_scratch(const Graph<T>& g, index_t r) const override {
    return g.tokens_per_sample() * g.tokens_per_sample() * r;
  }

  // W_Q, W_K and W_V (and their biases) are applied to every token of X: their cotangent rows are
  // gQ, gK and gV (kept by the last reverse pass).
  LinearUse<T> linear_use(const Graph<T>& g, int p) const override {
    if (p == wq()) return {g.value(x()), gQ_.data()};
    if (p == wk()) return {g.value(x()), gK_.data()};
    if (p == wv()) return {g.value(x()), gV_.data()};
    if (biased() && p == bq()) return {nullptr, gQ_.data()};
    if (biased() && p == bk()) return {nullptr, gK_.data()};
    if (biased() && p == bv()) return {nullptr, gV_.data()};
    return {};
  }

  // gA = gF V^T, gT = Jsm gA (row by row), head by head; the cotangents of Q, K and V,
  // gQ = s gT K, gK = s gT^T Q, gV = A^T gF (kept: curvature and vjp_tangent read them), then the
  // gradients X^T gQ, X^T gK, X^T gV (and their column sums for the biases) and, where the input
  // moves, its cotangent gQ W_Q^T + gK W_K^T + gV W_V^T.
  void vjp(Graph<T>& g) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    gA_.resize(g.backend(), A_.size()), gT_.resize(g.backend(), A_.size());
    gQ_.resize(g.backend(), Q_.size()), gK_.resize(g.backend(), K_.size()), gV_.resize(g.backend(), V_.size());
    const index_t LL = L * L;
    for (index_t b = 0; b < B; ++b)  // a batch of heads a sample
      batched_product(g.backend(), heads_, MapM<T>(gA_.data() + b * heads_ * LL, L, L), LL, head_cols(gF, b, 0, L),
                      dv_, v(b, 0, L).transpose(), dv_, T(1), false);
    g.backend().run(rows::SoftmaxVjpRows<T>{A_.data(), gA_.data(), gT_.data(), L}, B * heads_ * L);
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> gT(logit_cotangent(b, 0, L), L, L), A(weights(b, 0, L), L, L);
      batched_product(g.backend(), heads_, head_of(gQ_, b, 0, L, hk_, dk_), dk_, gT, LL, k(b, 0, L), dk_, s_, false);
      batched_product(g.backend(), heads_, head_of(gK_, b, 0, L, hk_, dk_), dk_, gT.transpose(), LL, q(b, 0, L), dk_, s_,
                      false);
      batched_product(g.backend(), heads_, head_of(gV_, b, 0, L, hv_, dv_), dv_, A.transpose(), LL,
                      head_cols(gF, b, 0, L), dv_, T(1), false);
    }
    require_finite(g.backend(), gT_.data(), static_cast<index_t>(gT_.size()), "block: the reverse pass through the attention weights");
    const MapC<T> X(g.value(x()), n, d), gQ(gQ_.data(), n, hk_), gK(gK_.data(), n, hk_), gV(gV_.data(), n, hv_);
    if (T* o = g.gradient_out(wq())) product(g.backend(), MapM<T>(o, d, hk_), X.transpose(), gQ, T(1), false);
    if (T* o = g.gradient_out(wk())) product(g.backend(), MapM<T>(o, d, hk_), X.transpose(), gK, T(1), false);
    if (T* o = g.gradient_out(wv())) product(g.backend(), MapM<T>(o, d, hv_), X.transpose(), gV, T(1), false);
    if (biased()) {
      if (T* o = g.gradient_out(bq())) token_sums(g, gQ_.data(), hk_, o);
      if (T* o = g.gradient_out(bk())) g.backend().run(rows::Zero<T>{o}, hk_);  // exactly: the rows of gT sum to 0
      if (T* o = g.gradient_out(bv())) token_sums(g, gV_.data(), hv_, o);
    }
    if (!g.varies(x())) return;
    const Slot<T> slot = g.cotangent_slot(x());
    MapM<T> gX(slot.data, n, d);
    product(g.backend(), gX, gQ, W(g, wq()).transpose(), T(1), slot.add);
    product(g.backend(), gX, gK, W(g, wk()).transpose(), T(1), true);
    product(g.backend(), gX, gV, W(g, wv()).transpose(), T(1), true);
  }

  void push(Graph<T>& g) const override {
    const index_t n = g.tokens(), d = g.width(x());
    mixed_.clear();
    bool input_moves = false, moves = false;  // a factor at its input; or a selected parameter of its own
    for (const Factor<T>* f : g.factors(x())) input_moves = input_moves || f->present;
    for (int p : this->params) moves = moves || g.selected(p);
    if (!moves && !input_moves) return;
    const Backend<T>& backend = g.backend();
    const SharedArray<T> ones = filled(backend, n, T(1));
    SharedArray<T> x_rows;
    for (index_t i = 0; i < heads_; ++i) {
      const bool query_side = g.selected(wq()) || (biased() && g.selected(bq()));
      const bool keys = g.selected(wk()), values = g.selected(wv()) || (biased() && g.selected(bv()));
      if (!query_side && !keys && !values) continue;
      // Every parameter of head i moves F on the head's rows: G_t is those rows of the identity
      // for all of them (factor.hpp), and R_t says how.
      Factor<T> head_rows;
      head_rows.present = true, head_rows.width = hv_;
      if (heads_ == 1) {
        head_rows.form = Form::identity;
      } else {
        BackendBuffer<T> E(backend, n * dv_ * hv_);
        backend.run(rows::HeadRows<T>{E.data(), hv_, dv_, i}, n * dv_ * hv_);
        head_rows.form = Form::dense;
        head_rows.U = shared_array(std::move(E));
      }
      auto with_right = [&](BackendBuffer<T>&& R) {
        Factor<T> f = head_rows;
        f.right = shared_array(std::move(R)), f.inner = dv_;
        return f;
      };
      if (query_side) {
        Factor<T> at_Q = with_right(right_factors(g, i, K_.data() + i * dk_, hk_, dk_, s_));
        if (g.selected(wq())) {
          const int piece = g.pieces_of(wq())[i];
          at_Q.split = g.split_of(piece, true);
          if (!x_rows) x_rows = g.value_copy(x());  // one copy, every head's W_Q
          at_Q.vec = x_rows;
          g.set_factor(this->output, piece, at_Q);
        }
        if (biased() && g.selected(bq())) {  // the same U_t, with vec [1]
          const int piece = g.pieces_of(bq())[i];
          at_Q.split = g.split_of(piece, true);
          at_Q.vec = ones;
          g.set_factor(this->output, piece, at_Q);
        }
      }
      if (keys) {
        BackendBuffer<T> sq(backend, n * dk_);
        backend.run(rows::ScaledColumns<T>{Q_.data(), sq.data(), dk_, hk_, i * dk_, s_}, n * dk_);
        Factor<T> f = with_right(right_factors(g, i, g.value(x()), d, d, T(1)));
        f.split = g.split_of(g.pieces_of(wk())[i], false);
        f.vec = shared_array(std::move(sq));
        g.set_factor(this->output, g.pieces_of(wk())[i], std::move(f));
      }
      if (!values) continue;
      // U_t = G_t itself: R_t = I.
      Factor<T> at_V = head_rows;
      if (g.selected(wv())) {
        BackendBuffer<T> AX(backend, n * d);
        const index_t L = g.tokens_per_sample();
        for (index_t b = 0; b < g.samples(); ++b)
          product(backend, MapM<T>(AX.data() + b * L * d, L, d), MapC<T>(weights(b, i, L), L, L), sample_x(g, b), T(1), false);
        const int piece = g.pieces_of(wv())[i];
        at_V.split = g.split_of(piece, true);
        at_V.vec = shared_array(std::move(AX));
        g.set_factor(this->output, piece, at_V);
      }
      if (biased() && g.selected(bv())) {
        const int piece = g.pieces_of(bv())[i];
        at_V.split = g.split_of(piece, true);
        at_V.vec = ones;
        g.set_factor(this->output, piece, at_V);
      }
    }
    if (!g.varies(x())) return;
    for (int f = 0; f < g.num_pieces(); ++f)
      if (g.factor(x(), f).present) {
        mixed_.push_back(mix(g, f));
        g.set_factor(this->output, f, mixed_.back().at_F);
      }
  }

  // The tokens right_factors() forms at a time: at most d_k, so that their diag(a_t) V_i rows are no
  // more than the sample's Mq_t.
  static index_t right_factor_chunk(index_t L, index_t dk) { return std::min(L, std::max<index_t>(1, dk)); }

  // Head i's right factors (tokens, d_v, cols), M_t = scale (V_i^T diag(a_t) Y - f_t (a_t^T Y)) for
  // Y the rows `cols` wide at `y` (`stride` apart, sample after sample): Mq_t with Y = K_i and
  // scale s, Mk_t with Y = X and scale 1. A chunk of a sample's tokens at a time: their diag(a_t) V_i
  // (rows::WeightedRows, right_factor_chunk() tokens), one product a token
  // against Y, the sums a_t^T Y as one product, then f_t (a_t^T Y)^T taken off as a product of depth
  // 1: the two products are rounded apart, so where attention is one-hot they are equal and M_t is
  // exactly 0.
  BackendBuffer<T> right_factors(const Graph<T>& g, index_t i, const T* y, index_t stride, index_t cols,
                                 T scale) const {
    const Backend<T>& backend = g.backend();
    const index_t L = g.tokens_per_sample(), n = g.tokens();
    const index_t chunk = right_factor_chunk(L, dk_);
    BackendBuffer<T> M(backend, n * dv_ * cols), Va(backend, chunk * L * dv_), bar(backend, chunk * cols);
    for (index_t b = 0; b < g.samples(); ++b) {
      const MapC<T> Y(y + b * L * stride, L, stride);
      for (index_t t0 = 0; t0 < L; t0 += chunk) {
        const index_t m = std::min(chunk, L - t0), t = b * L + t0;
        const T* a = weights(b, i, L) + t0 * L;
        backend.run(rows::WeightedRows<T>{a, V_.data() + b * L * hv_ + i * dv_, Va.data(), L, dv_, hv_}, m * L);
        T* Mt = M.data() + t * dv_ * cols;
        batched_product(backend, m, MapM<T>(Mt, dv_, cols), dv_ * cols, MapC<T>(Va.data(), L, dv_).transpose(),
                        L * dv_, Y.leftCols(cols), 0, T(1), false);
        product(backend, MapM<T>(bar.data(), m, cols), MapC<T>(a, m, L), Y.leftCols(cols), T(1), false);
        batched_product(backend, m, MapM<T>(Mt, dv_, cols), dv_ * cols,
                        MapC<T>(g.value(this->output) + t * hv_ + i * dv_, 1, dv_).transpose(), hv_,
                        MapC<T>(bar.data(), 1, cols), cols, T(-1), true);
      }
    }
    if (scale != T(1)) backend.run(rows::ScaleBy<T>{scale, M.data(), M.data()}, n * dv_ * cols);
    return M;
  }

  // dF/dX of sample b in closed form (docs/derivation.md §3.3), after forward: J (L h d_v, L d), row
  // t h d_v + i d_v + a, column u d + e. X enters V and both sides of T: head by head, with
  // Qt = Q_i W_K,i^T and Kt = K_i W_Q,i^T, each row written once and its finiteness marked while in
  // cache (rows::AttentionInputRows), the marks noted into `finite`. The forward tangents give the
  // same columns at L d times the cost.
  // input_jacobian's working memory beside the graph's: Q W_K^T and K W_Q^T of one sample, a mark a row.
  index_t input_jacobian_footprint(const Graph<T>& g) const { return g.tokens_per_sample() * (2 * g.width(x()) + g.width(this->output)); }
  void input_jacobian(const Graph<T>& g, index_t b, T* J, FiniteRecord* finite = nullptr) const {
    const Backend<T>& backend = g.backend();
    const index_t L = g.tokens_per_sample(), d = g.width(x());
    BackendBuffer<T> Qt(backend, L * d), Kt(backend, L * d), marks(backend, L * hv_);
    for (index_t i = 0; i < heads_; ++i) {
      product(backend, MapM<T>(Qt.data(), L, d), q(b, i, L), W(g, wk()).middleCols(i * dk_, dk_).transpose(), T(1), false);
      product(backend, MapM<T>(Kt.data(), L, d), k(b, i, L), W(g, wq()).middleCols(i * dk_, dk_).transpose(), T(1), false);
      backend.run(rows::AttentionInputRows<T>{weights(b, i, L), V_.data() + b * L * hv_, g.value(this->output) + b * L * hv_,
                                              g.weight(wv()), Qt.data(), Kt.data(), J, marks.data(), L, d, hv_, dv_, i, s_},
                  L * dv_);
    }
    if (finite) finite->note(backend.all_finite(marks.data(), L * hv_));
  }

  void curvature(const Graph<T>& g, Terms<T>& terms) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const T* ones = terms.kept(Buffer<T>(n, T(1)));
    for (index_t i = 0; i < heads_; ++i) {
      // Row t of the logits of head i moves by a matrix times the piece's vector: s K_i (W_Q, b_Q),
      // X (W_K), or dT_t (a parameter that moves the input, mix()).
      std::vector<int> logit_pieces;
      for (int p : {wq(), biased() ? bq() : -1, wk()})
        if (p >= 0 && g.selected(p)) logit_pieces.push_back(g.pieces_of(p)[i]);
      for (const Mixed& m : mixed_) logit_pieces.push_back(m.piece);
      const int key_piece = g.pieces_of(wk())[i];
      auto logit_matrix = [this, &g, L, i, key_piece](int piece, index_t t) -> Mat<T> {
        const index_t b = t / L;
        if (piece == key_piece) return sample_x(g, b);
        if (const Mixed* m = mixed(piece)) return MapC<T>(m->logits(i, t, L), L, m->r);
        return s_ * k(b, i, L);
      };
      // <gA_i, softmax''[dT_i, dT_i]>: the softmax site at T_i, with the logits' own factors.
      for (size_t a = 0; a < logit_pieces.size(); ++a)
        for (size_t c = a; c < logit_pieces.size(); ++c) {
          const int pi = logit_pieces[a], pj = logit_pieces[c];
          const Factor<T>&fi = g.factor(this->output, pi), &fj = g.factor(this->output, pj);
          auto site = [this, i, L](index_t t) {  // the softmax's second derivative on row t, contracted
            const index_t b = t / L, r = t % L;
            Mat<T> Hs(L, L);
            softmax::hessian_contract_row(weights(b, i, L) + r * L, logit_cotangent_of_weights(b, i, L) + r * L, L,
                                          Hs.data());
            return Hs;
          };
          terms.kron.push_back(KronTerm<T>{pi, pj, fi.split, fj.split, fi.vec->data(), fj.vec->data(),
                                           [site, logit_matrix, pi, pj](index_t t, T* out) {
                                             const Mat<T> Ui = logit_matrix(pi, t), Uj = logit_matrix(pj, t);
                                             MapM<T>(out, Ui.cols(), Uj.cols()).noalias() = Ui.transpose() * site(t) * Uj;
                                           },
                                           pi == pj});
          if (pi == pj)
            terms.kron.back().gamma_diagonal = [site, logit_matrix, pi](index_t t, T* out) {
              const Mat<T> U = logit_matrix(pi, t), HU = site(t) * U;
              Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(out, U.cols()) = U.cwiseProduct(HU).colwise().sum();
            };
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
                                             const Mat<T> U = logit_matrix(pi, t);
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
          product(g.backend(), MapM<T>(gTX.data() + b * L * d, L, d), MapC<T>(logit_cotangent(b, i, L), L, L), sample_x(g, b), s_,
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
      if (!mixed_.empty()) moving_input_terms(g, terms, i, logit_pieces, logit_matrix, ones);
    }
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T *dWQ = tg.dW[wq()], *dWK = tg.dW[wk()], *dWV = tg.dW[wv()];
    const T *dbQ = biased() ? tg.dW[bq()] : nullptr, *dbK = biased() ? tg.dW[bk()] : nullptr;
    const T* dbV = biased() ? tg.dW[bv()] : nullptr;
    const T* dX = tg.in(x());
    if (!dWQ && !dWK && !dWV && !dbQ && !dbK && !dbV && !dX) return;
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const MapC<T> X(g.value(x()), n, d);
    // dX W + X dW + 1 db, zero where nothing moves.
    auto tangent_of = [&](int slot, int weight, const T* dW, const T* db, index_t cols) -> const BackendBuffer<T>& {
      BackendBuffer<T>& out = tg.scratch(this->index, slot, n * cols);
      MapM<T> o(out.data(), n, cols);
      if (dW) product(g.backend(), o, X, MapC<T>(dW, d, cols), T(1), false);
      if (dX) product(g.backend(), o, MapC<T>(dX, n, d), W(g, weight), T(1), dW != nullptr);
      if (!dW && !dX) g.backend().run(rows::Zero<T>{o.data()}, n * cols);
      if (db) g.backend().run(rows::AddBias<T>{db, o.data(), cols}, n * cols);
      return out;
    };
    const BackendBuffer<T>&dQ = tangent_of(kDQ, wq(), dWQ, dbQ, hk_), &dK = tangent_of(kDK, wk(), dWK, dbK, hk_);
    const BackendBuffer<T>& dV = tangent_of(kDV, wv(), dWV, dbV, hv_);
    BackendBuffer<T>& dA = tg.scratch(this->index, kDA, static_cast<index_t>(A_.size()));
    MapM<T> dT(tg.scratch(this->index, kRows, L * L).data(), L, L);
    T* dF = tg.out(this->output, n * hv_);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        product(g.backend(), dT, head(dQ, b, i, L, hk_, dk_), k(b, i, L).transpose(), s_, false);
        product(g.backend(), dT, q(b, i, L), head(dK, b, i, L, hk_, dk_).transpose(), s_, true);
        const T* A = weights(b, i, L);
        T* dAi = dA.data() + (b * heads_ + i) * L * L;
        g.backend().run(rows::SoftmaxVjpRows<T>{A, dT.data(), dAi, L}, L);  // J is symmetric: J dT = J^T dT
        const auto dFi = head_cols(dF, b, i, L);
        product(g.backend(), dFi, MapC<T>(dAi, L, L), v(b, i, L), T(1), false);
        product(g.backend(), dFi, MapC<T>(A, L, L), head(dV, b, i, L, hv_, dv_), T(1), true);
      }
  }

  // The tangents of gQ = s gT K, gK = s gT^T Q and gV = A^T gF (the product rule, with gT's own
  // tangent from the softmax), then of the gradients X^T gQ, ... and of the input's cotangent.
  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const override {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const T* dgF = tg.dcot[this->output].data();
    const T* dX = tg.in(x());
    // Which inputs move: a weight, its bias or the input (the tangents dQ, dK, dV of jvp hold all).
    const bool moves_q = dX || tg.dW[wq()] || (biased() && tg.dW[bq()]);
    const bool moves_k = dX || tg.dW[wk()] || (biased() && tg.dW[bk()]);
    const bool moves_v = dX || tg.dW[wv()] || (biased() && tg.dW[bv()]);
    const index_t nA = static_cast<index_t>(A_.size());
    const BackendBuffer<T>&dQ = tg.scratch(this->index, kDQ, n * hk_), &dK = tg.scratch(this->index, kDK, n * hk_);
    const BackendBuffer<T>&dV = tg.scratch(this->index, kDV, n * hv_), &dA = tg.scratch(this->index, kDA, nA);
    BackendBuffer<T>& dgQ = tg.scratch(this->index, kDgQ, n * hk_);
    BackendBuffer<T>& dgK = tg.scratch(this->index, kDgK, n * hk_);
    BackendBuffer<T>& dgV = tg.scratch(this->index, kDgV, n * hv_);
    const MapM<T> dgA(tg.scratch(this->index, kRows, L * L).data(), L, L);
    MapM<T> dgT(tg.scratch(this->index, kDgT, L * L).data(), L, L);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        product(g.backend(), dgA, head_cols(dgF, b, i, L), v(b, i, L).transpose(), T(1), false);
        if (curved && moves_v) product(g.backend(), dgA, head_cols(gF, b, i, L), head(dV, b, i, L, hv_, dv_).transpose(), T(1), true);
        const index_t at = (b * heads_ + i) * L * L;
        if (curved)
          g.backend().run(rows::SoftmaxCotangentTangentRows<T>{A_.data() + at, dA.data() + at, gA_.data() + at,
                                                               dgA.data(), dgT.data(), L},
                          L);
        else g.backend().run(rows::SoftmaxVjpRows<T>{A_.data() + at, dgA.data(), dgT.data(), L}, L);
        const MapC<T> gT(gT_.data() + at, L, L), A(A_.data() + at, L, L), dAi(dA.data() + at, L, L);
        auto dgQi = head_of(dgQ, b, i, L, hk_, dk_);
        product(g.backend(), dgQi, dgT, k(b, i, L), s_, false);
        if (curved && moves_k) product(g.backend(), dgQi, gT, head(dK, b, i, L, hk_, dk_), s_, true);
        auto dgKi = head_of(dgK, b, i, L, hk_, dk_);
        product(g.backend(), dgKi, dgT.transpose(), q(b, i, L), s_, false);
        if (curved && moves_q) product(g.backend(), dgKi, gT.transpose(), head(dQ, b, i, L, hk_, dk_), s_, true);
        auto dgVi = head_of(dgV, b, i, L, hv_, dv_);
        product(g.backend(), dgVi, A.transpose(), head_cols(dgF, b, i, L), T(1), false);
        if (curved) product(g.backend(), dgVi, dAi.transpose(), head_cols(gF, b, i, L), T(1), true);
      }
    const MapC<T> X(g.value(x()), n, d);
    const MapC<T> gQ(gQ_.data(), n, hk_), gK(gK_.data(), n, hk_), gV(gV_.data(), n, hv_);
    const MapC<T> dgQm(dgQ.data(), n, hk_), dgKm(dgK.data(), n, hk_), dgVm(dgV.data(), n, hv_);
    // d(X^T g) = X^T dg + (curved) dX^T g for each of the three weights.
    auto weight_tangent = [&](T* out, index_t cols, const MapC<T>& dg, const MapC<T>& g0) {
      if (!out) return;
      MapM<T> o(out, d, cols);
      product(g.backend(), o, X.transpose(), dg, T(1), false);
      if (curved && dX) product(g.backend(), o, MapC<T>(dX, n, d).transpose(), g0, T(1), true);
    };
    weight_tangent(tg.dgrad[wq()], hk_, dgQm, gQ);
    weight_tangent(tg.dgrad[wk()], hk_, dgKm, gK);
    weight_tangent(tg.dgrad[wv()], hv_, dgVm, gV);
    if (biased()) {
      if (T* o = tg.dgrad[bq()]) token_sums(g, dgQ.data(), hk_, o);
      if (T* o = tg.dgrad[bk()]) g.backend().run(rows::Zero<T>{o}, hk_);  // b_K moves nothing: its rows of H v are exactly 0
      if (T* o = tg.dgrad[bv()]) token_sums(g, dgV.data(), hv_, o);
    }
    if (!dX) return;
    // d(gQ W_Q^T + ...) = dgQ W_Q^T + (curved) gQ dW_Q^T + ...
    const Slot<T> slot = tg.dcot_slot(x(), n * d);
    MapM<T> dgX(slot.data, n, d);
    product(g.backend(), dgX, dgQm, W(g, wq()).transpose(), T(1), slot.add);
    product(g.backend(), dgX, dgKm, W(g, wk()).transpose(), T(1), true);
    product(g.backend(), dgX, dgVm, W(g, wv()).transpose(), T(1), true);
    if (!curved) return;
    if (const T* dW = tg.dW[wq()]) product(g.backend(), dgX, gQ, MapC<T>(dW, d, hk_).transpose(), T(1), true);
    if (const T* dW = tg.dW[wk()]) product(g.backend(), dgX, gK, MapC<T>(dW, d, hk_).transpose(), T(1), true);
    if (const T* dW = tg.dW[wv()]) product(g.backend(), dgX, gV, MapC<T>(dW, d, hv_).transpose(), T(1), true);
  }

 private:
  // A parameter that moves the input (a pre-LN block's gamma_1, beta_1) with a factor whose vector is
  // the same for every token: mixing the tokens keeps it a factor, U_F,t = sum_s (dF_t/dx_s) M_s,
  // M_t the input's U_t. Its products with the weights are kept transposed, a token's (r, width)
  // rows one after another, as a dense G_t is (factor.hpp): one product for every token.
  struct Mixed {
    int piece = -1;
    index_t r = 0, tokens = 0;
    Factor<T> input;        // the factor at X, M_t = its U_t
    Factor<T> at_F;
    SharedArray<T> Pq, Pk;  // (n, r, h d_k): (W_Q^T M_t)^T, (W_K^T M_t)^T (how Q_t and K_t move)
    SharedArray<T> Pv;      // (n, r, h d_v): (W_V^T M_t)^T
    BackendBuffer<T> dT;    // (heads, n, L, r): how row t of each head's logits moves
    const T* logits(index_t i, index_t t, index_t L) const { return dT.data() + (i * tokens + t) * L * r; }
    // Head i's (cols, r) block of Pq_t, Pk_t or Pv_t (`P` of `width` columns) as a matrix.
    static auto head(const SharedArray<T>& P, index_t t, index_t r, index_t width, index_t i, index_t cols) {
      return MapC<T>(P->data() + t * r * width, r, width).middleCols(i * cols, cols).transpose();
    }
  };

  const Mixed* mixed(int piece) const {
    for (const Mixed& m : mixed_)
      if (m.piece == piece) return &m;
    return nullptr;
  }

  // dQ_t = Pq_t, dK_s = Pk_s, dV_s = Pv_s (times the parameter's tangent); per head
  //   dT_t = s (K_i Pq_t + [q_t^T Pk_s]_s),   U_F,t = sum_s a_ts Pv_s + V_i^T Jsm_t dT_t,
  // on the graph's backend: every token's products with a weight at once, then per sample and head
  // the sums over its tokens as products (one for all its tokens, or one a token or a column of r).
  Mixed mix(const Graph<T>& g, int f) const {
    const Backend<T>& backend = g.backend();
    const Factor<T>& in = g.factor(x(), f);
    const index_t L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x()), r = in.n_mat();
    bool constant = in.split.n_vec() == 1;
    if (constant) {
      const HostView<T, T> vec(backend, in.vec->data(), n);
      for (index_t t = 1; constant && t < n; ++t) constant = vec.data()[t] == vec.data()[0];
    }
    if (!constant)
      // A stack's lower layer under this attention: its factors would need a dense slab per token.
      throw FactorsDoNotReach("engine: " + g.parameter(g.piece(f).param).name + " moves the input of an attention, "
                              "which mixes tokens, differently at each token: the per-token factors do not reach it");
    Mixed m;
    m.piece = f, m.r = r, m.tokens = n, m.input = in;
    m.Pq = through_weight(backend, in, n, g.weight(wq()), d, hk_);
    m.Pk = through_weight(backend, in, n, g.weight(wk()), d, hk_);
    m.Pv = through_weight(backend, in, n, g.weight(wv()), d, hv_);
    m.dT.resize(backend, heads_ * n * L * r);
    BackendBuffer<T> UF(backend, n * r * hv_), JdT(backend, L * L * r);  // U_F,t^T (r, h d_v); Jsm_t dT_t (L, r)
    for (index_t b = 0; b < n / L; ++b)
      for (index_t i = 0; i < heads_; ++i) {
        const index_t t0 = b * L;
        T* dT_b = m.dT.data() + (i * n + t0) * L * r;  // (L, L r): row t is token t's (L, r)
        const T* Pq = m.Pq->data() + t0 * r * hk_ + i * dk_;  // head i's columns, (L r, d_k) hk apart
        const T* Pk = m.Pk->data() + t0 * r * hk_ + i * dk_;
        const T* Pv = m.Pv->data() + t0 * r * hv_ + i * dv_;
        T* UF_b = UF.data() + t0 * r * hv_ + i * dv_;
        // [q_t^T Pk_u]_u for all t: Q_i (L, d_k) times the keys' tangents, (d_k, L r) as they lie.
        backend.gemm(MatrixView<T>{dT_b, L, L * r, L * r, true}, MatrixView<const T>{Q_.data() + t0 * hk_ + i * dk_, L, dk_, hk_, true},
                     MatrixView<const T>{Pk, dk_, L * r, hk_, false}, s_, false);
        // + K_i Pq_t, a product a token.
        backend.gemm_batched(L, MatrixView<T>{dT_b, L, r, r, true}, L * r,
                             MatrixView<const T>{K_.data() + t0 * hk_ + i * dk_, L, dk_, hk_, true}, 0,
                             MatrixView<const T>{Pq, dk_, r, hk_, false}, r * hk_, s_, true);
        // U_F,t^T on the head's columns: sum_u a_tu Pv_u^T, a product a column of the r (A_i times
        // that column of every token's Pv_u^T) ...
        backend.gemm_batched(r, MatrixView<T>{UF_b, L, dv_, r * hv_, true}, hv_, MatrixView<const T>{weights(b, i, L), L, L, L, true}, 0,
                             MatrixView<const T>{Pv, L, dv_, r * hv_, true}, hv_, T(1), false);
        // ... + (Jsm_t dT_t)^T V_i, a product a token.
        backend.run(rows::SoftmaxJacobianColumns<T>{weights(b, i, L), dT_b, JdT.data(), L, r}, L * r);
        backend.gemm_batched(L, MatrixView<T>{UF_b, r, dv_, hv_, true}, r * hv_, MatrixView<const T>{JdT.data(), r, L, r, false}, L * r,
                             MatrixView<const T>{V_.data() + t0 * hv_ + i * dv_, L, dv_, hv_, true}, 0, T(1), true);
      }
    m.at_F.present = true;
    m.at_F.split = in.split;
    m.at_F.vec = in.vec;
    m.at_F.form = Form::dense;
    m.at_F.width = hv_;
    m.at_F.U = shared_array(std::move(UF));
    return m;
  }

  // The curvature of head i that involves a moving input: <gF_i, dA_i dV_i> with dV moved by it,
  // <gT_i, s dQ_i dK_i^T> with either side moved by it, and the maps Q = X W_Q, K = X W_K,
  // V = X W_V, bilinear in (X, W).
  template <class LogitMatrix>
  void moving_input_terms(const Graph<T>& g, Terms<T>& terms, index_t i, const std::vector<int>& logit_pieces,
                          const LogitMatrix& logit_matrix, const T* ones) const {
    const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens(), d = g.width(x());
    const T* gF = g.cotangent(this->output);
    const int q_piece = g.pieces_of(wq())[i], k_piece = g.pieces_of(wk())[i], v_piece = g.pieces_of(wv())[i];
    auto symmetrised = [](auto gamma, index_t r) {
      return [gamma, r](index_t t, T* out) {
        gamma(t, out);
        MapM<T> G(out, r, r);
        G = (G + G.transpose()).eval();
      };
    };
    for (const Mixed& mv : mixed_) {
      const index_t rv = mv.r;
      // <gF_i, dA_i dV_i>, dV_s = Pv_s: Gamma_t = (Jsm_t U_a,t)^T G_t, row s of G_t = gF_t,i^T Pv_s,i.
      for (int pa : logit_pieces) {
        const Factor<T>& fa = g.factor(this->output, pa);
        const index_t ra = fa.n_mat();
        auto gamma = [this, &mv, logit_matrix, pa, gF, L, i, ra, rv](index_t t, T* out) {
          const index_t b = t / L, row = t % L;
          const Vec a(weights(b, i, L) + row * L, L);
          const Mat<T> U = logit_matrix(pa, t);
          const Mat<T> JU = a.asDiagonal() * U - a * (a.transpose() * U);
          const auto gFt = MapC<T>(gF + t * hv_ + i * dv_, 1, dv_);
          Mat<T> G(L, rv);
          for (index_t u = 0; u < L; ++u)
            G.row(u).noalias() = gFt * Mixed::head(mv.Pv, b * L + u, rv, hv_, i, dv_);
          MapM<T>(out, ra, rv).noalias() = JU.transpose() * G;
        };
        if (pa == mv.piece) terms.kron.push_back(KronTerm<T>{pa, pa, fa.split, fa.split, fa.vec->data(), fa.vec->data(), symmetrised(gamma, rv), true});
        else terms.kron.push_back(KronTerm<T>{pa, mv.piece, fa.split, mv.at_F.split, fa.vec->data(), mv.at_F.vec->data(), gamma, false});
      }
      // <gT_i, s dQ_i dK_i^T>: the key side moved by the input, SK_t = s sum_u gT_tu Pk_u,i (d_k, r),
      // and the query side, SQ_u = s sum_t gT_tu Pq_t,i (d_k, r) at key u.
      Buffer<T> PqI(n * dk_ * rv), PkI(n * dk_ * rv), SK(n * dk_ * rv), SQ(n * dk_ * rv);
      for (index_t t = 0; t < n; ++t) {
        MapM<T>(PqI.data() + t * dk_ * rv, dk_, rv) = Mixed::head(mv.Pq, t, rv, hk_, i, dk_);
        MapM<T>(PkI.data() + t * dk_ * rv, dk_, rv) = Mixed::head(mv.Pk, t, rv, hk_, i, dk_);
      }
      for (index_t b = 0; b < B; ++b) {
        const MapC<T> gT(logit_cotangent(b, i, L), L, L);
        product(g.backend(), MapM<T>(SK.data() + b * L * dk_ * rv, L, dk_ * rv), gT, MapC<T>(PkI.data() + b * L * dk_ * rv, L, dk_ * rv), s_, false);
        product(g.backend(), MapM<T>(SQ.data() + b * L * dk_ * rv, L, dk_ * rv), gT.transpose(), MapC<T>(PqI.data() + b * L * dk_ * rv, L, dk_ * rv), s_, false);
      }
      const T* sk = terms.kept(std::move(SK));
      const T* sq = terms.kept(std::move(SQ));
      const T* pq = terms.kept(std::move(PqI));
      const index_t dk = dk_;
      auto copy_of = [dk, rv](const T* base) {
        return [base, dk, rv](index_t t, T* out) { std::copy_n(base + t * dk * rv, dk * rv, out); };
      };
      if (g.selected(wq())) terms.kron.push_back(KronTerm<T>{q_piece, mv.piece, g.split_of(q_piece, true), mv.at_F.split, g.value(x()), mv.at_F.vec->data(), copy_of(sk), false});
      if (biased() && g.selected(bq())) {
        const int piece = g.pieces_of(bq())[i];
        terms.kron.push_back(KronTerm<T>{piece, mv.piece, g.split_of(piece, true), mv.at_F.split, ones, mv.at_F.vec->data(), copy_of(sk), false});
      }
      if (g.selected(wk()))
        terms.kron.push_back(KronTerm<T>{mv.piece, k_piece, mv.at_F.split, g.split_of(k_piece, true), mv.at_F.vec->data(), g.value(x()),
                                         [sq, dk, rv](index_t t, T* out) { MapM<T>(out, rv, dk) = MapC<T>(sq + t * dk * rv, dk, rv).transpose(); },
                                         false});
      for (const Mixed& mk : mixed_) {  // both sides moved by the input: Gamma_t = s Pq_t,f^T SK'_t
        const index_t rk = mk.r;
        // SK for mk's key side (recomputed where mk is not mv)
        const T* skk = sk;
        if (&mk != &mv) {
          Buffer<T> PkK(n * dk_ * rk), SKK(n * dk_ * rk);
          for (index_t t = 0; t < n; ++t)
            MapM<T>(PkK.data() + t * dk_ * rk, dk_, rk) = Mixed::head(mk.Pk, t, rk, hk_, i, dk_);
          for (index_t b = 0; b < B; ++b)
            product(g.backend(), MapM<T>(SKK.data() + b * L * dk_ * rk, L, dk_ * rk), MapC<T>(logit_cotangent(b, i, L), L, L),
                    MapC<T>(PkK.data() + b * L * dk_ * rk, L, dk_ * rk), s_, false);
          skk = terms.kept(std::move(SKK));
        }
        auto gamma = [pq, skk, dk, rv, rk](index_t t, T* out) {
          MapM<T>(out, rv, rk).noalias() = MapC<T>(pq + t * dk * rv, dk, rv).transpose() * MapC<T>(skk + t * dk * rk, dk, rk);
        };
        if (&mk == &mv) terms.kron.push_back(KronTerm<T>{mv.piece, mv.piece, mv.at_F.split, mv.at_F.split, mv.at_F.vec->data(), mv.at_F.vec->data(), symmetrised(gamma, rv), true});
        else terms.kron.push_back(KronTerm<T>{mv.piece, mk.piece, mv.at_F.split, mk.at_F.split, mv.at_F.vec->data(), mk.at_F.vec->data(), gamma, false});
      }
      // <gQ, dX dW_Q>, <gK, dX dW_K>, <gV, dX dW_V> on head i's columns: Gamma_t = M_t^T.
      auto input_matrix = [input = mv.input, d, rv](index_t t, T* out) {
        Mat<T> M;
        input.materialise(t, M);
        MapM<T>(out, rv, d) = M.transpose();
      };
      auto head_copy = [&](const BackendBuffer<T>& full, index_t width, index_t cols) {
        Buffer<T> out(n * cols);
        for (index_t t = 0; t < n; ++t) std::copy_n(full.data() + t * width + i * cols, cols, out.data() + t * cols);
        return terms.kept(std::move(out));
      };
      if (g.selected(wq())) terms.kron.push_back(KronTerm<T>{mv.piece, q_piece, mv.at_F.split, g.split_of(q_piece, false), mv.at_F.vec->data(), head_copy(gQ_, hk_, dk_), input_matrix, false});
      if (g.selected(wk())) terms.kron.push_back(KronTerm<T>{mv.piece, k_piece, mv.at_F.split, g.split_of(k_piece, false), mv.at_F.vec->data(), head_copy(gK_, hk_, dk_), input_matrix, false});
      if (g.selected(wv())) terms.kron.push_back(KronTerm<T>{mv.piece, v_piece, mv.at_F.split, g.split_of(v_piece, false), mv.at_F.vec->data(), head_copy(gV_, hv_, dv_), input_matrix, false});
    }
  }

  // Per-product scratch slots in a Tangent.
  enum : int { kDQ, kDK, kDV, kDA, kRows, kDgT, kDgQ, kDgK, kDgV };

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
  template <class Rows>
  static auto head(const Rows& rows, index_t b, index_t i, index_t L, index_t width, index_t cols) {
    return MapC<T>(rows.data() + b * L * width, L, width).middleCols(i * cols, cols);
  }
  template <class Rows>
  static auto head_of(Rows& rows, index_t b, index_t i, index_t L, index_t width, index_t cols) {
    return MapM<T>(rows.data() + b * L * width, L, width).middleCols(i * cols, cols);
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
  BackendBuffer<T> Q_, K_, V_, A_;          // A: (B, heads, L, L)
  mutable BackendBuffer<T> gA_, gT_;        // the reverse pass's (vjp), read by curvature and vjp_tangent
  mutable BackendBuffer<T> gQ_, gK_, gV_;   // the cotangents of Q, K, V
  mutable std::vector<Mixed> mixed_;  // the parameters that move the input (push), read by curvature
};

}  // namespace blockhess::engine
