// Loss value, gradient and Hessian of the Transformer block over a batch (docs/derivation.md §4, H^(k)).
#pragma once

#include <memory>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/block_target.hpp"
#include "blockhess/loss.hpp"

namespace blockhess::block {

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
  const auto ld = target.derivatives(B, D.L, D.d, e.output(), false);
  require_finite_loss(ld, B * D.L * D.d);
  if (grad) {
    e.reverse(ld.gZ.data(), grad);
    index_t P = 0;
    for (const ParamShape& s : e.shapes()) P += s.size();
    require_finite(grad, P, "block: the loss gradient");
  }
  return ld.value;
}

// What a loss Hessian and its diagonal are assembled from: the loss's derivatives at Z (its outer
// curvature there) and the reverse pass run with its gradient. Returns the loss value.
template <class T>
T prepare_curvature(Evaluation<T>& e, const Target<T>& target, Part part, OuterCurvature<T>& outer) {
  const Dims& D = e.dims();
  const index_t B = e.samples();
  const bool with_outer = part != Part::functional;
  auto ld = target.derivatives(B, D.L, D.d, e.output(), with_outer);
  require_finite_loss(ld, B * D.L * D.d);
  e.reverse(ld.gZ.data());
  auto share = [](Buffer<T>& b) { return std::make_shared<const Buffer<T>>(std::move(b)); };
  outer = OuterCurvature<T>{};
  const bool pooled = with_outer && target.pooled();
  if (with_outer && !pooled) outer.hessZ = share(ld.hessZ), outer.diagonal = ld.hessZ_diagonal;
  if (pooled) outer.pooledZ = share(ld.pooledZ);
  return ld.value;
}

// The factors of the parameters in `wrt`, pushed (to Z too for a pooled head's outer part, which
// sums each sample's Jacobian at Z over its tokens).
template <class T>
void push_curvature_factors(Evaluation<T>& e, const OuterCurvature<T>& outer, const Selection& wrt) {
  e.graph().select(wrt);
  e.graph().push_factors(/*to_output=*/outer.pooledZ != nullptr);
}

// The (P, P) loss Hessian (or its outer / functional part) over the selected parameters, written
// through `out` (engine::HostHessian, or the GPU's DeviceHessian).
template <class T, class Out>
T loss_hessian_into(Evaluation<T>& e, const Target<T>& target, Part part, const Selection& wrt, Out& out) {
  OuterCurvature<T> outer;
  const T value = prepare_curvature(e, target, part, outer);
  push_curvature_factors(e, outer, wrt);
  assemble_hessian_into(e, outer, part, wrt, out);
  return value;
}
// Into host memory H (P x P).
template <class T>
T loss_hessian(Evaluation<T>& e, const Target<T>& target, Part part, const Selection& wrt, T* H) {
  index_t P = 0;
  selected_offsets(e, wrt, &P);
  engine::HostHessian<T> out{H, P};
  return loss_hessian_into(e, target, part, wrt, out);
}

// The diagonal of that Hessian (P entries), exact, with no block of it formed: its trace and
// per-parameter traces at sizes where no (P, P) matrix fits. An entry (p, p) needs p's factors
// only, so it is formed a group of parameters at a time (one node's, which share their pushes:
// Graph::factor_groups): the factors held at once are one group's, not every selected parameter's.
template <class T>
T loss_hessian_diagonal(Evaluation<T>& e, const Target<T>& target, Part part, const Selection& wrt, T* diag) {
  OuterCurvature<T> outer;
  const T value = prepare_curvature(e, target, part, outer);
  index_t P = 0;
  selected_offsets(e, wrt, &P);
  std::fill_n(diag, P, T(0));
  for (const std::vector<int>& group : e.graph().factor_groups()) {
    Selection some(wrt.size(), false);
    bool any = false;
    for (int p : group) some[static_cast<size_t>(p)] = wrt[static_cast<size_t>(p)], any = any || wrt[static_cast<size_t>(p)];
    if (!any) continue;
    push_curvature_factors(e, outer, some);
    add_hessian_diagonal(e, outer, part, wrt, diag);
  }
  require_finite(diag, P, "block: the Hessian's diagonal");
  return value;
}

}  // namespace blockhess::block
