// The loss of a wired graph (a head at its output, head.hpp) and its derivatives with respect to the
// parameters: the value and gradient, the dense Hessian (or its outer / functional part) over a
// selection of parameters, its exact diagonal, and the Hessian as a matrix-free operator.
//
// Second differential of the loss l(Z(W)) (docs/derivation.md §4.1, with the corrected blocks of
// its §4.4):  d2l = dZ^T H_l dZ  (the outer, Gauss-Newton part: the head's site at Z)
//                 + the nodes' own second derivatives contracted with the reverse pass's cotangents
//                   (the functional part: Graph::curvature).
// Dense assembly (assemble.hpp), the diagonal (diagonal.hpp) and the product (Graph::hvp) consume
// the same terms; nothing P x P is formed for a product.
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/diagonal.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/terms.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::engine {

// The loss at g's output (its forward pass done) and the reverse pass run with its gradient: the
// cotangents every curvature term reads. Writes the gradient of every parameter (in the graph's
// order) into grad unless it is null.
template <class T>
T reverse_loss(Graph<T>& g, Head<T>& head, T* grad = nullptr) {
  const index_t n = g.tokens() * g.width(g.output());
  Buffer<T> gZ(static_cast<size_t>(n));
  const T value = head.forward(g, gZ.data());
  // A target far outside Z's range can overflow the loss and its gradient.
  require_finite(&value, 1, "block: the loss value");
  require_finite(gZ.data(), n, "block: the loss gradient with respect to Z");
  const std::vector<bool> all(static_cast<size_t>(g.num_params()), true);
  index_t P = 0;
  const std::vector<index_t> off = g.offsets(all, &P);
  std::vector<T*> gradient(off.size(), nullptr);
  if (grad)
    for (size_t p = 0; p < off.size(); ++p) gradient[p] = grad + off[p];
  g.reverse(gZ.data(), std::move(gradient));
  if (grad) require_finite(grad, P, "block: the loss gradient");
  return value;
}

// The head's curvature (the outer part), computed once; empty for the functional part.
template <class T>
Terms<T> outer_terms(const Graph<T>& g, const Head<T>& head, Part part) {
  Terms<T> terms;
  if (part != Part::functional) head.curvature(g, terms);
  return terms;
}

// The terms of the loss Hessian's part: the nodes' curvature (functional) and the head's (outer).
template <class T>
Terms<T> loss_terms(const Graph<T>& g, const Terms<T>& outer, Part part) {
  Terms<T> terms;
  if (part != Part::outer) terms = g.curvature();
  terms.sites.insert(terms.sites.end(), outer.sites.begin(), outer.sites.end());
  terms.pooled.insert(terms.pooled.end(), outer.pooled.begin(), outer.pooled.end());
  return terms;
}

// The selected parameters' factors, pushed (to Z too where the head's outer site couples tokens).
template <class T>
void push_loss_factors(Graph<T>& g, const Head<T>& head, Part part, const std::vector<bool>& wrt) {
  g.select(wrt);
  g.push_factors(/*to_output=*/head.couples_tokens() && part != Part::functional);
}

// The symmetric (P, P) loss Hessian (or its part) over the selected parameters, written through
// `out` (HostHessian, or the GPU's DeviceHessian). Returns the loss.
template <class T, class Out>
T loss_hessian_into(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, Out& out) {
  const T value = reverse_loss(g, head);
  push_loss_factors(g, head, part, wrt);
  assemble(g, loss_terms(g, outer_terms(g, head, part), part), g.offsets(wrt), out);
  return value;
}
// Into host memory H (P x P).
template <class T>
T loss_hessian(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, T* H) {
  index_t P = 0;
  g.offsets(wrt, &P);
  HostHessian<T> out{H, P};
  return loss_hessian_into(g, head, part, wrt, out);
}

// The diagonal of that Hessian (P entries), exact, with no block of it formed: its trace and
// per-parameter traces at sizes where no (P, P) matrix fits. An entry (p, p) needs p's factors
// only, so it is formed a group of parameters at a time (one node's, which share their pushes:
// Graph::factor_groups): the factors held at once are one group's, not every selected parameter's.
template <class T>
T loss_hessian_diagonal(Graph<T>& g, Head<T>& head, Part part, const std::vector<bool>& wrt, T* diag) {
  const T value = reverse_loss(g, head);
  const Terms<T> outer = outer_terms(g, head, part);
  index_t P = 0;
  const std::vector<index_t> offset = g.offsets(wrt, &P);
  std::fill_n(diag, P, T(0));
  for (const std::vector<int>& group : g.factor_groups()) {
    std::vector<bool> some(wrt.size(), false);
    bool any = false;
    for (int p : group) some[static_cast<size_t>(p)] = wrt[static_cast<size_t>(p)], any = any || wrt[static_cast<size_t>(p)];
    if (!any) continue;
    push_loss_factors(g, head, part, some);
    add_diagonal(g, loss_terms(g, outer, part), offset, diag);
  }
  require_finite(diag, P, "block: the Hessian's diagonal");
  return value;
}

// The loss Hessian (or its part) over the selected parameters as an operator, matrix-free:
//   H v is the derivative of the gradient along v (forward over reverse, in closed form):
//   1. push the tangent v forward through the graph (every node's jvp);
//   2. carry the tangent of the reverse pass back. Each cotangent g_x = J_x^T g_y moves for two
//      reasons: its seed moves (dg_y), and the node's Jacobian moves with the primal (the node's
//      second derivatives contracted with g_y, or a bilinear term where two varying operands multiply).
// The outer part keeps only the first reason, seeded with dgZ = H_l dZ (Head::vjp_tangent); the
// functional part keeps only the second with dgZ = 0; their sum is the full product. The forward
// pass, the head and the reverse pass do not depend on v: they run once, at construction, and
// every product reuses them.
template <class T>
class LossOperator {
 public:
  LossOperator(std::unique_ptr<Graph<T>> g, std::unique_ptr<Head<T>> head, Part part, const std::vector<bool>& wrt)
      : g_(std::move(g)), head_(std::move(head)), part_(part) {
    value_ = reverse_loss(*g_, *head_);
    g_->select(wrt);
    offset_ = g_->offsets(wrt, &size_);
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
    blockhess::detail::parallel_for(k, P * g_->tokens(), [&](index_t j) {
      Buffer<T> column(P), result(P);
      for (index_t i = 0; i < P; ++i) column[i] = V[i * k + j];
      apply(column.data(), result.data());
      for (index_t i = 0; i < P; ++i) out[i * k + j] = result[i];
    });
  }

 private:
  // The tangents of one product in flight. Kept by the operator and reused (one per concurrent
  // product), so that repeated products do not fault in fresh pages every time.
  using Scratch = Tangent<T>;
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
    explicit ScratchLease(const LossOperator& op) : owner(op), scratch(op.acquire()) {}
    ~ScratchLease() { owner.release(scratch); }
    ScratchLease(const ScratchLease&) = delete;
    ScratchLease& operator=(const ScratchLease&) = delete;
    const LossOperator& owner;
    Scratch& scratch;
  };

  void apply(const T* v, T* out, Scratch& ws) const {
    const bool seeded = part_ != Part::functional, curved = part_ != Part::outer;
    auto seed = [&](const T* dZ, T* dgZ) {
      if (seeded) head_->vjp_tangent(*g_, dZ, dgZ);
      return seeded;
    };
    std::fill_n(out, size_, T(0));  // a selected parameter that reaches nothing has zero rows
    g_->hvp(ws, offset_, v, seed, curved, out);
    require_finite(out, size_, "block: the Hessian-vector product H v (a vector of smaller magnitude may fit)");
  }

  std::unique_ptr<Graph<T>> g_;
  std::unique_ptr<Head<T>> head_;
  Part part_;
  std::vector<index_t> offset_;
  index_t size_ = 0;
  T value_ = 0;
  mutable std::mutex scratch_mutex_;
  mutable std::vector<std::unique_ptr<Scratch>> scratch_;
  mutable std::vector<Scratch*> idle_scratch_;
};

}  // namespace blockhess::engine
