// Exact Hessian-vector products of the block's loss, matrix-free: nothing P x P is ever formed.
// The engine computes them (engine/graph.hpp, hvp) from the nodes' jvp and vjp_tangent:
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
  HessianOperator(Evaluation<T>&& e, const Target<T>& target, Part part, const Selection& wrt)
      : e_(std::move(e)), kind_(target.kind), part_(part) {
    const Dims& D = e_.dims();
    const index_t B = e_.samples();
    auto ld = target.derivatives(B, D.L, D.d, e_.output(), false);
    require_finite_loss(ld, B * D.L * D.d);
    value_ = ld.value;
    pooledZ_ = std::move(ld.pooledZ);  // empty unless the loss is pooled
    e_.reverse(ld.gZ.data());
    e_.graph().select(wrt);
    offset_ = selected_offsets(e_, wrt, &size_);
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
    const Dims& D = e_.dims();
    const index_t work = e_.tokens() * (D.L + D.d) * (D.d + D.dk + D.dff) * 4;
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
  using Scratch = engine::Tangent<T>;
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

  // The outer part seeds the reverse pass's tangent with H_loss dZ; the functional part adds the
  // nodes' own second derivatives (engine/graph.hpp, hvp).
  void apply(const T* v, T* out, Scratch& ws) const {
    const Dims& D = e_.dims();
    const bool seed = part_ != Part::functional, curved = part_ != Part::outer;
    auto seed_with_loss = [&](const T* dZ, T* dgZ) {
      if (seed) loss::hessian_apply(kind_, e_.samples(), D.L, D.d, e_.output(), dZ, dgZ, pooledZ_.data());
      return seed;
    };
    std::fill_n(out, size_, T(0));  // a selected parameter that reaches nothing has zero rows
    e_.graph().hvp(ws, offset_, v, seed_with_loss, curved, out);
    require_finite(out, size_, "block: the Hessian-vector product H v (a vector of smaller magnitude may fit)");
  }

  Evaluation<T> e_;
  loss::Kind kind_;
  Buffer<T> pooledZ_;  // a pooled head's per-sample Hessian blocks at Z (loss.hpp)
  Part part_;
  std::vector<index_t> offset_;
  index_t size_ = 0;
  T value_ = 0;
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<Scratch>> scratch_;
  mutable std::vector<Scratch*> idle_scratch_;
};

}  // namespace blockhess::block
