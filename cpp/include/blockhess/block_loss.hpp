// Loss value, gradient and Hessian of the Transformer block over a batch (spec §3.8, H^(k)).
#pragma once

#include <cstdint>

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

// Returns the loss; writes its gradient (sum of the five parameter sizes) when grad is not null.
template <class T>
T loss_gradient(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps, const Target<T>& target, T* grad) {
  const Forward<T> f = forward(D, B, X, W, eps);
  const auto ld = loss::derivatives(target.kind, B, D.L, D.d, f.Z.data(), target.values, target.classes, false);
  if (grad) weight_gradient(f, reverse(f, ld.gZ.data()), grad);
  return ld.value;
}

// The (P, P) loss Hessian (or its outer / functional part) over the selected parameters.
template <class T>
T loss_hessian(const Dims& D, index_t B, const T* X, const Weights<T>& W, T eps, const Target<T>& target,
               Part part, const Selection& wrt, T* H) {
  const Forward<T> f = forward(D, B, X, W, eps);
  const auto ld = loss::derivatives(target.kind, B, D.L, D.d, f.Z.data(), target.values, target.classes,
                                    part != Part::functional);
  const Factors<T> fa = factorize(f);
  const Reverse<T> r = reverse(f, ld.gZ.data());
  assemble_hessian(f, fa, r, ld.gZ.data(), part != Part::functional ? ld.hessZ.data() : nullptr, part, wrt, H);
  return ld.value;
}

}  // namespace blockhess::block
