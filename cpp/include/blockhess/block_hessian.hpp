// Exact Jacobians and Hessians of the Transformer block with respect to its five weight matrices.
//
// Second differential of a scalar l(Z(W)) (a loss, or one output entry):
//   d2l = dZ^T H_l dZ                                   outer (Gauss-Newton) part: a site at Z
//       + <gZ, LN2''[dS,dS]> + <gY, LN1''[dF,dF]>       LayerNorm sites
//       + 2<gS, dR dW_2> + 2<gH1, dY dW_1>              the linear maps' bilinear terms (relu'' = 0 a.e.)
//       + 2<gF, dA dV> + <gA, softmax''[dT,dT]> + 2<gT, dQ dK^T>/sqrt(d_k)   attention
// (g* are the cotangents of the reverse pass.) This is docs/derivation.md §4.1 with the corrected
// xi / Phi blocks of its §4.4 (errata E3-E8). Each line is one node's curvature() (engine/nodes/);
// the engine assembles them from the per-token factors (engine/assemble.hpp).
#pragma once

#include <memory>
#include <vector>

#include "blockhess/block.hpp"
#include "blockhess/block_target.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/diagonal.hpp"
#include "blockhess/layernorm.hpp"

namespace blockhess::block {

// Where each parameter sits in the flattened vector of the selected ones; *total: their size.
template <class T>
std::vector<index_t> selected_offsets(const Evaluation<T>& e, const Selection& wrt, index_t* total) {
  std::vector<index_t> off;
  const index_t P = offsets(e.shapes(), wrt, off);
  if (total) *total = P;
  return off;
}

// The outer (Gauss-Newton) curvature of a loss at Z: per token (hessZ, d x d blocks, or only their
// diagonals when `diagonal`: mse), or per sample for a pooled head (pooledZ, one d x d block
// coupling every pair of its tokens; it needs the factors at Z, push_factors(true)). Empty: none.
template <class T>
struct OuterCurvature {
  std::shared_ptr<const Buffer<T>> hessZ;
  bool diagonal = false;
  std::shared_ptr<const Buffer<T>> pooledZ;
};

// The terms of the Hessian of the scalar whose cotangent at Z is gZ (the reverse pass of `e` must
// have been run with it) and whose outer curvature at Z is `outer`.
template <class T>
engine::Terms<T> hessian_terms(const Evaluation<T>& e, const OuterCurvature<T>& outer, Part part) {
  const engine::Graph<T>& g = e.graph();
  engine::Terms<T> terms;
  if (part != Part::outer) terms = g.curvature();
  if (part == Part::functional) return terms;
  if (outer.hessZ) terms.sites.push_back(engine::Site<T>{g.output(), outer.hessZ, outer.diagonal});
  if (outer.pooledZ) terms.pooled.push_back(engine::PooledSite<T>{g.output(), outer.pooledZ});
  return terms;
}

// Writes that symmetric (P, P) Hessian, restricted to the parameters whose factors `e` holds
// (push_factors).
// `out` is where: engine::HostHessian (host memory) or the GPU's DeviceHessian.
template <class T, class Out>
void assemble_hessian_into(const Evaluation<T>& e, const OuterCurvature<T>& outer, Part part, const Selection& wrt,
                      Out& out) {
  engine::assemble(e.graph(), hessian_terms(e, outer, part), selected_offsets(e, wrt, nullptr), out);
}
template <class T>
void assemble_hessian(const Evaluation<T>& e, const OuterCurvature<T>& outer, Part part, const Selection& wrt, T* H) {
  index_t P = 0;
  selected_offsets(e, wrt, &P);
  engine::HostHessian<T> out{H, P};
  assemble_hessian_into(e, outer, part, wrt, out);
}

// diag (P entries, laid out as `wrt` selects) += the diagonal of the same Hessian on the
// parameters whose factors `e` holds, with no block of it formed (engine/diagonal.hpp).
template <class T>
void add_hessian_diagonal(const Evaluation<T>& e, const OuterCurvature<T>& outer, Part part, const Selection& wrt,
                          T* diag) {
  const std::vector<index_t> offset = selected_offsets(e, wrt, nullptr);
  engine::add_diagonal(e.graph(), hessian_terms(e, outer, part), offset, diag);
}

// dZ/dW_p for one sample: (L d, n_p), from p's factor at Z (engine/derivatives.hpp).
template <class T>
void jacobian(Evaluation<T>& e, int p, T* J) {
  engine::jacobian(e.graph(), p, J);
}

// d2 Z / dW_i dW_j for one sample, assembled through `out` and read by take (engine/derivatives.hpp),
// each reverse pass checked as the block's are.
template <class T, class Out, class Take>
void output_hessians(Evaluation<T>& e, int i, int j, Out& out, Take&& take) {
  engine::output_hessians(e.graph(), i, j, [&e](const T* gZ) { e.reverse(gZ); }, out, std::forward<Take>(take));
}

// The same in host memory, in the paper's layout (L d n_i, n_j).
template <class T>
void output_hessian(Evaluation<T>& e, int i, int j, T* out) {
  engine::output_hessian(e.graph(), i, j, [&e](const T* gZ) { e.reverse(gZ); }, out);
}

}  // namespace blockhess::block
