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

// dZ/dW_p for one sample: (L d, n_p), from p's factor at Z.
template <class T>
void jacobian(Evaluation<T>& e, int p, T* J) {
  engine::Graph<T>& g = e.graph();
  Selection only(e.shapes().size(), false);
  only.at(static_cast<size_t>(p)) = true;
  g.select(only);
  g.push_factors(/*to_output=*/true);
  const index_t d = e.dims().d, np = e.shapes()[static_cast<size_t>(p)].size();
  std::fill_n(J, e.tokens() * d * np, T(0));  // a piece that does not move the output (a key bias) stays 0
  for (int piece : g.pieces_of(p)) {
    const engine::Factor<T>& f = g.factor(g.output(), piece);
    if (!f.present) continue;
    const index_t no = f.split.n_vec(), nr = f.n_mat();
    blockhess::detail::parallel_for(e.tokens(), d * np, [&](index_t t) {
      Mat<T> U;
      f.materialise(t, U);
      const T* v = f.vec->data() + t * no;
      for (index_t a = 0; a < d; ++a) {
        T* row = J + (t * d + a) * np;
        for (index_t o = 0; o < no; ++o)
          for (index_t r = 0; r < nr; ++r) row[f.split.flat(o, r)] = v[o] * U(a, r);
      }
    });
  }
}

// d2 Z / dW_i dW_j for one sample: for each output entry o, the Hessian of Z_o (whose cotangent
// is the unit vector e_o) over W_i and W_j, assembled through `out` (a (P, P) target: HostHessian,
// or the GPU's DeviceHessian); then take(o, row, col, n_i, n_j) reads its (i, j) block, which
// starts at (row, col).
// The selection of parameters i and j (one parameter when i == j); *P: its size.
template <class T>
Selection pair_selection(const Evaluation<T>& e, int i, int j, index_t* P) {
  Selection wrt(e.shapes().size(), false);
  wrt.at(static_cast<size_t>(i)) = wrt.at(static_cast<size_t>(j)) = true;
  selected_offsets(e, wrt, P);
  return wrt;
}

template <class T, class Out, class Take>
void output_hessians(Evaluation<T>& e, int i, int j, Out& out, Take&& take) {
  const Selection wrt = pair_selection(e, i, j, nullptr);
  e.graph().select(wrt);
  e.graph().push_factors(/*to_output=*/false);
  const std::vector<index_t> off = selected_offsets(e, wrt, nullptr);
  const index_t ni = e.shapes()[static_cast<size_t>(i)].size(), nj = e.shapes()[static_cast<size_t>(j)].size();
  const index_t m = e.tokens() * e.dims().d;
  Buffer<T> gZ(m, T(0));
  for (index_t o = 0; o < m; ++o) {
    gZ[o] = T(1);
    e.reverse(gZ.data());
    assemble_hessian_into(e, OuterCurvature<T>{}, Part::functional, wrt, out);
    take(o, off[static_cast<size_t>(i)], off[static_cast<size_t>(j)], ni, nj);
    gZ[o] = T(0);
  }
}

// The same in host memory, in the paper's layout (L d n_i, n_j).
template <class T>
void output_hessian(Evaluation<T>& e, int i, int j, T* out) {
  index_t P = 0;
  pair_selection(e, i, j, &P);
  Buffer<T> H(P * P);
  engine::HostHessian<T> target{H.data(), P};
  output_hessians(e, i, j, target, [&](index_t o, index_t row, index_t col, index_t ni, index_t nj) {
    for (index_t a = 0; a < ni; ++a) std::copy_n(H.data() + (row + a) * P + col, nj, out + (o * ni + a) * nj);
  });
}

// The paper's block (the default spec).
template <class T>
void output_hessian(const Dims& D, const T* X, const Weights<T>& W, T eps, int i, int j, T* out) {
  Evaluation<T> e = forward(D, 1, X, W, eps);
  output_hessian(e, i, j, out);
}

}  // namespace blockhess::block
