// Exact Hessian-vector products of the block's loss, matrix-free: nothing P x P is ever formed.
//
// H v is the derivative of the gradient along v (forward over reverse, in closed form):
//   1. push the tangent v = (dW_Q, ..., dW_2) forward through the block: dQ, dK, dV, dT, dA, dF,
//      dY, dH1, dR, dS, dZ (every node's Jacobian applied to its inputs' tangents);
//   2. carry the tangent of the reverse pass back. Each cotangent g_x = J_x^T g_y moves for two
//      reasons: its seed moves (dg_y), and the node's Jacobian moves with the primal (dJ_x^T g_y,
//      the node's second derivative contracted with g_y, or a bilinear term where two varying
//      operands multiply).
// The outer (Gauss-Newton) part J^T H_loss J v keeps only the first reason with the seed
// dgZ = H_loss dZ; the functional part keeps only the second with dgZ = 0. Both are linear in v and
// their sum is the full product. The forward pass, the loss derivatives and the reverse pass do not
// depend on v: an Operator computes them once and every product reuses them.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/block_loss.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/loss.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::block {

template <class T>
class HessianOperator {
 public:
  HessianOperator(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps, const Target<T>& target,
                  Part part, const Selection& wrt)
      : f_(forward(D, B, X, W, eps)), kind_(target.kind), part_(part), wrt_(wrt) {
    auto ld = loss::derivatives(target.kind, B, D.L, D.d, f_.Z.data(), target.values, target.classes, false);
    require_finite_loss(ld, B * D.L * D.d);
    value_ = ld.value;
    gZ_ = std::move(ld.gZ);
    r_ = reverse(f_, gZ_.data());
    size_ = offsets(D, wrt, offset_);
  }

  index_t size() const { return size_; }
  T loss_value() const { return value_; }

  // out = H v for one vector v of length size().
  void apply(const T* v, T* out) const {
    const ScratchLease lease(*this);
    apply(v, out, lease.scratch);
  }

  // out = H V for V of shape (size(), k), both row-major. Columns are independent products, run in
  // parallel; each is computed the same way whichever thread runs it (bit-reproducible).
  void apply_columns(const T* V, index_t k, T* out) const {
    const index_t P = size_;
    if (k == 1) return apply(V, out);
    const Dims& D = f_.dims;
    const index_t work = f_.tokens() * (D.L + D.d) * (D.d + D.dk + D.dff) * 4;
    blockhess::detail::parallel_for(k, work, [&](index_t j) {
      Buffer<T> column(P), result(P);
      for (index_t i = 0; i < P; ++i) column[i] = V[i * k + j];
      apply(column.data(), result.data());
      for (index_t i = 0; i < P; ++i) out[i * k + j] = result[i];
    });
  }

 private:
  // The tangents of one product in flight. Kept by the operator and reused (one per concurrent
  // product), so that repeated products do not fault in fresh pages every time.
  struct Scratch {
    Buffer<T> dQ, dK, dV, dT, dA, dF, dY, dH1, dR, dS, dZ;  // forward tangent
    Buffer<T> dgZ, dgS, du, dgH1, dgY, dgF, dgA, dgT;       // tangent of the reverse pass
    Buffer<T> inner_q, inner_k, inner_v;                    // per-sample products for W_Q, W_K, W_V
  };
  Scratch& acquire() const {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    if (idle_scratch_.empty()) {
      scratch_.push_back(std::make_unique<Scratch>());
      return *scratch_.back();
    }
    Scratch* ws = idle_scratch_.back();
    idle_scratch_.pop_back();
    return *ws;
  }
  void release(Scratch& ws) const {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    idle_scratch_.push_back(&ws);
  }
  // One product's hold on a Scratch, given back however the product ends.
  struct ScratchLease {
    explicit ScratchLease(const HessianOperator& op) : owner(op), scratch(op.acquire()) {}
    ~ScratchLease() { owner.release(scratch); }
    ScratchLease(const ScratchLease&) = delete;
    ScratchLease& operator=(const ScratchLease&) = delete;
    const HessianOperator& owner;
    Scratch& scratch;
  };
  void apply(const T* v, T* out, Scratch& ws) const;

  Forward<T> f_;
  Buffer<T> gZ_;
  Reverse<T> r_;
  loss::Kind kind_;
  Part part_;
  Selection wrt_;
  std::array<index_t, kNumParams> offset_{};
  index_t size_ = 0;
  T value_ = 0;
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<Scratch>> scratch_;
  mutable std::vector<Scratch*> idle_scratch_;
};

template <class T>
void HessianOperator<T>::apply(const T* v, T* out, Scratch& ws) const {
  const Forward<T>& f = f_;
  const Reverse<T>& r = r_;
  const Dims& D = f.dims;
  const index_t B = f.B, L = D.L, d = D.d, dk = D.dk, dff = D.dff, n = f.tokens();
  const T s = f.inv_sqrt_dk();
  const bool seed = part_ != Part::functional;  // the outer part: the reverse pass seeded with H_loss dZ
  const bool curved = part_ != Part::outer;     // the functional part: the Jacobians' own tangents
  // The tangent of each weight (a row-major matrix inside v), or null where wrt leaves it out.
  std::array<const T*, kNumParams> dW{};
  for (int p = 0; p < kNumParams; ++p) dW[p] = wrt_[p] ? v + offset_[p] : nullptr;
  const MapC<T> X(f.X, n, d), Y(f.Y.data(), n, d), R(f.R.data(), n, dff);
  const MapC<T> W1(f.weight(W_1), d, dff), W2(f.weight(W_2), dff, d);
  auto relu_mask = [&](Buffer<T>& m) {  // relu'(0) is taken as 0, as in the forward pass
    for (index_t k = 0; k < n * dff; ++k)
      if (!(f.H1[k] > T(0))) m[k] = T(0);
  };

  auto sized = [](Buffer<T>& buffer, index_t size) -> Buffer<T>& {
    buffer.resize(static_cast<size_t>(size));
    return buffer;
  };
  // X dW, or zero for a weight that wrt leaves out.
  auto input_times = [&](Buffer<T>& out_buffer, int p, index_t cols) -> Buffer<T>& {
    sized(out_buffer, n * cols);
    if (dW[p]) product(MapM<T>(out_buffer.data(), n, cols), X, MapC<T>(dW[p], d, cols), T(1), false);
    else std::fill(out_buffer.begin(), out_buffer.end(), T(0));
    return out_buffer;
  };

  // 1. Forward tangent.
  const Buffer<T>& dQ = input_times(ws.dQ, W_Q, dk);
  const Buffer<T>& dK = input_times(ws.dK, W_K, dk);
  const Buffer<T>& dV = input_times(ws.dV, W_V, d);
  Buffer<T>& dA = sized(ws.dA, B * L * L);
  Buffer<T>& dF = sized(ws.dF, n * d);
  {
    MapM<T> dT(sized(ws.dT, L * L).data(), L, L);
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> Qb(f.Q.data() + b * L * dk, L, dk), Kb(f.K.data() + b * L * dk, L, dk);
      const MapC<T> dQb(dQ.data() + b * L * dk, L, dk), dKb(dK.data() + b * L * dk, L, dk);
      product(dT, dQb, Kb.transpose(), s, false);
      product(dT, Qb, dKb.transpose(), s, true);
      const T* A = f.A.data() + b * L * L;
      T* dAb = dA.data() + b * L * L;
      for (index_t i = 0; i < L; ++i) softmax::vjp_row(A + i * L, dT.data() + i * L, L, dAb + i * L);  // J is symmetric
      const MapM<T> dFb(dF.data() + b * L * d, L, d);
      product(dFb, MapC<T>(dAb, L, L), MapC<T>(f.V.data() + b * L * d, L, d), T(1), false);
      product(dFb, MapC<T>(A, L, L), MapC<T>(dV.data() + b * L * d, L, d), T(1), true);
    }
  }
  Buffer<T>& dY = sized(ws.dY, n * d);
  Buffer<T>& dH1 = sized(ws.dH1, n * dff);
  Buffer<T>& dR = ws.dR;
  Buffer<T>& dS = sized(ws.dS, n * d);
  Buffer<T>& dZ = sized(ws.dZ, n * d);
  for (index_t t = 0; t < n; ++t)
    layernorm::vjp_row(f.Y.data() + t * d, f.sigma1[t], dF.data() + t * d, d, dY.data() + t * d);
  const MapM<T> dH1m(dH1.data(), n, dff);
  product(dH1m, MapC<T>(dY.data(), n, d), W1, T(1), false);
  if (dW[W_1]) product(dH1m, Y, MapC<T>(dW[W_1], d, dff), T(1), true);
  dR = dH1;
  relu_mask(dR);
  MapM<T> dSm(dS.data(), n, d);
  product(dSm, MapC<T>(dR.data(), n, dff), W2, T(1), false);
  if (dW[W_2]) product(dSm, R, MapC<T>(dW[W_2], dff, d), T(1), true);
  dSm += MapC<T>(dY.data(), n, d);
  for (index_t t = 0; t < n; ++t)
    layernorm::vjp_row(f.Z.data() + t * d, f.sigma2[t], dS.data() + t * d, d, dZ.data() + t * d);

  // 2. Tangent of the reverse pass.
  Buffer<T>& dgS = sized(ws.dgS, n * d);
  Buffer<T>& du = sized(ws.du, d);
  std::fill(dgS.begin(), dgS.end(), T(0));
  if (seed) {
    Buffer<T>& dgZ = sized(ws.dgZ, n * d);
    loss::hessian_apply(kind_, B, L, d, f.Z.data(), dZ.data(), dgZ.data());
    for (index_t t = 0; t < n; ++t)
      layernorm::vjp_row(f.Z.data() + t * d, f.sigma2[t], dgZ.data() + t * d, d, dgS.data() + t * d);
  }
  if (curved)
    for (index_t t = 0; t < n; ++t) {
      layernorm::vjp_tangent_row(f.Z.data() + t * d, f.sigma2[t], gZ_.data() + t * d, r.gS.data() + t * d,
                                 dS.data() + t * d, dZ.data() + t * d, d, du.data());
      for (index_t a = 0; a < d; ++a) dgS[t * d + a] += du[a];
    }
  const MapC<T> gS(r.gS.data(), n, d), gH1(r.gH1.data(), n, dff), dgSm(dgS.data(), n, d);
  Buffer<T>& dgH1 = sized(ws.dgH1, n * dff);
  Buffer<T>& dgY = sized(ws.dgY, n * d);
  Buffer<T>& dgF = sized(ws.dgF, n * d);
  const MapM<T> dgH1m(dgH1.data(), n, dff);
  MapM<T> dgYm(dgY.data(), n, d);
  product(dgH1m, dgSm, W2.transpose(), T(1), false);
  if (curved && dW[W_2]) product(dgH1m, gS, MapC<T>(dW[W_2], dff, d).transpose(), T(1), true);
  relu_mask(dgH1);  // relu'' = 0: the mask itself does not move
  product(dgYm, dgH1m, W1.transpose(), T(1), false);
  if (curved && dW[W_1]) product(dgYm, gH1, MapC<T>(dW[W_1], d, dff).transpose(), T(1), true);
  dgYm += dgSm;
  for (index_t t = 0; t < n; ++t) {
    T* dgFt = dgF.data() + t * d;
    layernorm::vjp_row(f.Y.data() + t * d, f.sigma1[t], dgY.data() + t * d, d, dgFt);
    if (!curved) continue;
    layernorm::vjp_tangent_row(f.Y.data() + t * d, f.sigma1[t], r.gY.data() + t * d, r.gF.data() + t * d,
                               dF.data() + t * d, dY.data() + t * d, d, du.data());
    for (index_t a = 0; a < d; ++a) dgFt[a] += du[a];
  }
  Buffer<T>& dgT = sized(ws.dgT, B * L * L);
  {
    Buffer<T>& dgA = sized(ws.dgA, L * L);
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> Vb(f.V.data() + b * L * d, L, d), dVb(dV.data() + b * L * d, L, d);
      const MapM<T> dgAm(dgA.data(), L, L);
      product(dgAm, MapC<T>(dgF.data() + b * L * d, L, d), Vb.transpose(), T(1), false);
      if (curved && dW[W_V]) product(dgAm, MapC<T>(r.gF.data() + b * L * d, L, d), dVb.transpose(), T(1), true);
      const T *A = f.A.data() + b * L * L, *gA = r.gA.data() + b * L * L, *dAb = dA.data() + b * L * L;
      T* dgTb = dgT.data() + b * L * L;
      for (index_t i = 0; i < L; ++i) {
        const index_t row = i * L;
        if (curved) softmax::vjp_tangent_row(A + row, dAb + row, gA + row, dgA.data() + row, L, dgTb + row);
        else softmax::vjp_row(A + row, dgA.data() + row, L, dgTb + row);
      }
    }
  }

  // 3. The weights' cotangent tangents: each weight gradient's derivative, product rule.
  if (dW[W_Q] || dW[W_K] || dW[W_V]) {
    Buffer<T>&inner_q = sized(ws.inner_q, L * dk), &inner_k = sized(ws.inner_k, L * dk);
    Buffer<T>& inner_v = sized(ws.inner_v, L * d);
    auto zero = [&](int p, index_t rows, index_t cols) {
      if (wrt_[p]) MapM<T>(out + offset_[p], rows, cols).setZero();
    };
    zero(W_Q, d, dk), zero(W_K, d, dk), zero(W_V, d, d);
    for (index_t b = 0; b < B; ++b) {
      const MapC<T> Xb(f.X + b * L * d, L, d), Qb(f.Q.data() + b * L * dk, L, dk), Kb(f.K.data() + b * L * dk, L, dk);
      const MapC<T> dQb(dQ.data() + b * L * dk, L, dk), dKb(dK.data() + b * L * dk, L, dk);
      const MapC<T> gT(r.gT.data() + b * L * L, L, L), dgTb(dgT.data() + b * L * L, L, L);
      const MapC<T> A(f.A.data() + b * L * L, L, L), dAb(dA.data() + b * L * L, L, L);
      const MapM<T> iq(inner_q.data(), L, dk), ik(inner_k.data(), L, dk), iv(inner_v.data(), L, d);
      if (wrt_[W_Q]) {
        product(iq, dgTb, Kb, T(1), false);
        if (curved && dW[W_K]) product(iq, gT, dKb, T(1), true);
        product(MapM<T>(out + offset_[W_Q], d, dk), Xb.transpose(), iq, s, true);
      }
      if (wrt_[W_K]) {
        product(ik, dgTb.transpose(), Qb, T(1), false);
        if (curved && dW[W_Q]) product(ik, gT.transpose(), dQb, T(1), true);
        product(MapM<T>(out + offset_[W_K], d, dk), Xb.transpose(), ik, s, true);
      }
      if (wrt_[W_V]) {
        product(iv, A.transpose(), MapC<T>(dgF.data() + b * L * d, L, d), T(1), false);
        if (curved) product(iv, dAb.transpose(), MapC<T>(r.gF.data() + b * L * d, L, d), T(1), true);
        product(MapM<T>(out + offset_[W_V], d, d), Xb.transpose(), iv, T(1), true);
      }
    }
  }
  if (wrt_[W_1]) {
    const MapM<T> o(out + offset_[W_1], d, dff);
    product(o, Y.transpose(), dgH1m, T(1), false);
    if (curved) product(o, MapC<T>(dY.data(), n, d).transpose(), gH1, T(1), true);
  }
  if (wrt_[W_2]) {
    const MapM<T> o(out + offset_[W_2], dff, d);
    product(o, R.transpose(), dgSm, T(1), false);
    if (curved) product(o, MapC<T>(dR.data(), n, dff).transpose(), gS, T(1), true);
  }
  require_finite(out, size_, "block: the Hessian-vector product H v (a vector of smaller magnitude may fit)");
}

}  // namespace blockhess::block
