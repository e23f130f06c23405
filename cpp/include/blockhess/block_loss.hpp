// Loss value, gradient and Hessian of the Transformer block over a batch (docs/derivation.md §4, H^(k)).
#pragma once

#include <cstdint>
#include <memory>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/loss.hpp"

namespace blockhess::block {

// What the loss is measured against: float targets (mse) or class indices (cross_entropy).
template <class T>
struct Target {
  loss::Kind kind = loss::Kind::mse;
  const T* values = nullptr;            // (B*L, d)
  const std::int64_t* classes = nullptr;  // (B*L)
};

// The loss and its derivatives with respect to Z: a target far outside Z's range (|Z| <= sqrt(d))
// can overflow them.
template <class T>
void require_finite_loss(const loss::Derivatives<T>& ld, index_t entries) {
  require_finite(&ld.value, 1, "block: the loss value");
  require_finite(ld.gZ.data(), entries, "block: the loss gradient with respect to Z");
}

// Returns the loss; writes its gradient (every parameter, in the canonical order) when grad is
// not null.
template <class T>
T loss_gradient(Evaluation<T>& e, const Target<T>& target, T* grad) {
  const Dims& D = e.dims();
  const index_t B = e.samples();
  const auto ld = loss::derivatives(target.kind, B, D.L, D.d, e.output(), target.values, target.classes, false);
  require_finite_loss(ld, B * D.L * D.d);
  if (grad) {
    e.reverse(ld.gZ.data(), grad);
    index_t P = 0;
    for (const ParamShape& s : e.shapes()) P += s.size();
    require_finite(grad, P, "block: the loss gradient");
  }
  return ld.value;
}

// The (P, P) loss Hessian (or its outer / functional part) over the selected parameters.
template <class T>
T loss_hessian(Evaluation<T>& e, const Target<T>& target, Part part, const Selection& wrt, T* H) {
  const Dims& D = e.dims();
  const index_t B = e.samples();
  const bool outer = part != Part::functional;
  auto ld = loss::derivatives(target.kind, B, D.L, D.d, e.output(), target.values, target.classes, outer);
  require_finite_loss(ld, B * D.L * D.d);
  e.reverse(ld.gZ.data());
  e.graph().select(wrt);
  e.graph().push_factors(/*to_output=*/false);
  assemble_hessian(e, outer ? std::make_shared<const Buffer<T>>(std::move(ld.hessZ)) : nullptr, part, wrt, H);
  return ld.value;
}

// The paper's block (the default spec).
template <class T>
T loss_gradient(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps, const Target<T>& target, T* grad) {
  Evaluation<T> e = forward(D, B, X, W, eps);
  return loss_gradient(e, target, grad);
}
template <class T>
T loss_hessian(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps, const Target<T>& target, Part part,
               const Selection& wrt, T* H) {
  Evaluation<T> e = forward(D, B, X, W, eps);
  return loss_hessian(e, target, part, wrt, H);
}

}  // namespace blockhess::block
