// Derivatives of a graph's output itself (no loss), for any wiring: its Jacobian with respect to a
// parameter (from the parameter's tangent factors at the output), its forward tangents along
// tangents of its input (Graph::jvp_input: columns of the input Jacobian), and its second
// derivatives with respect to two parameters (one reverse pass and one assembly per output entry).
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/thread_pool.hpp"

namespace blockhess::engine {

// Where the per-token factors do not reach p (a lower block of a stack, an embedding:
// FactorsDoNotReach): column k of dZ/dW_p is the output's forward tangent along the unit tangent
// e_k of p, one forward tangent per entry of p (docs/derivation.md §5.4), on g's backend: on the
// host in parallel, one Tangent per thread, each computed the same way whichever thread runs it;
// on a GPU one after another on its stream.
template <class T>
void jacobian_by_tangents(const Graph<T>& g, int p, T* J, FiniteRecord* finite) {
  const Backend<T>& backend = g.backend();
  const bool host = backend.host_addressable();
  const index_t m = g.tokens() * g.width(g.output()), np = g.parameter(p).size();
  const int slots = host ? parallel::num_threads() : 1;
  std::vector<Tangent<T>> tangents(static_cast<size_t>(slots));
  std::vector<BackendBuffer<T>> units;  // a slot's tangent: zero but for the entry it moves
  for (int slot = 0; slot < slots; ++slot) {
    units.emplace_back(backend, np);
    backend.run(rows::Zero<T>{units.back().data()}, np);
  }
  backend.run(rows::Zero<T>{J}, m * np);  // the columns of entries that do not reach the output
  const index_t work = 4 * m;  // about a forward pass's multiply-adds per output entry
  blockhess::detail::parallel_for_slots(np, host && np * work >= blockhess::detail::kParallelWorkThreshold,
                                        blockhess::detail::chunk_size(np, work, slots), slots, [&](index_t k, int slot) {
    T* unit = units[static_cast<size_t>(slot)].data();
    backend.run(rows::Fill<T>{unit + k, T(1)}, 1);
    if (const T* dZ = g.jvp_parameter(tangents[static_cast<size_t>(slot)], p, unit))
      backend.run(rows::WriteStrided<T>{dZ, J + k, np}, m);
    backend.run(rows::Fill<T>{unit + k, T(0)}, 1);
  });
  if (finite) finite->note(backend.all_finite(J, m * np));
}

// Rows t width + a of `out` (row_length long) = vec_t (x) U_t[a, :] at the columns `s` places
// them in (rows::FactorOuterRows), vec null for U_t alone, on `backend`; whether every value
// written is finite, where `check`.
template <class T>
bool outer_rows(const Backend<T>& backend, index_t tokens, const T* vec, const T* U, rows::FactorLayout layout,
                index_t width, const kron::Split& s, T* out, index_t row_length, bool check = true) {
  BackendBuffer<T> marks(backend, check ? tokens * width : 0);
  const index_t n_vec = vec ? s.n_vec() : 1, offset = vec ? s.offset : 0, stride = vec ? s.row_stride() : s.n_mat();
  backend.run(rows::FactorOuterRows<T>{vec, U, layout, width, n_vec, s.n_mat(), out, row_length, offset, stride,
                                       s.vec_on_first || !vec, check ? marks.data() : nullptr},
              tokens * width);
  return !check || backend.all_finite(marks.data(), tokens * width);
}

// The rows of dZ/dW_p that factor f at the output gives (its piece's columns), row length n_p;
// vec null: U_t alone, (tokens, width, n_mat) (an FFN's Kronecker factor).
template <class T>
bool factor_rows(const Graph<T>& g, const Factor<T>& f, const T* vec, T* J, index_t row_length, bool check = true) {
  BackendBuffer<T> formed;
  const auto [U, layout] = applied(g.backend(), f, g.tokens(), formed);
  return outer_rows(g.backend(), g.tokens(), vec, U, layout, f.width, f.split, J, row_length, check);
}

// dZ/dW_p: (tokens width(Z), n_p), row t w + a, column p's flat index, on g's backend. Each piece
// of a split parameter writes its own columns of every row; a piece that does not move the output
// (a key bias) leaves its columns 0. Checked into `finite` (when given) where written.
template <class T>
void jacobian(Graph<T>& g, int p, T* J, FiniteRecord* finite = nullptr) {
  std::vector<bool> only(static_cast<size_t>(g.num_params()), false);
  only.at(static_cast<size_t>(p)) = true;
  g.select(only);
  try {
    g.push_factors(/*to_output=*/true);
  } catch (const FactorsDoNotReach&) {
    g.clear_factors();
    jacobian_by_tangents(g, p, J, finite);
    return;
  }
  const index_t np = g.parameter(p).size();
  std::vector<const Factor<T>*> moving;
  for (int piece : g.pieces_of(p))
    if (g.factor(g.output(), piece).present) moving.push_back(&g.factor(g.output(), piece));
  if (moving.size() != g.pieces_of(p).size()) g.backend().run(rows::Zero<T>{J}, g.tokens() * g.width(g.output()) * np);
  for (const Factor<T>* f : moving) {
    const bool ok = factor_rows(g, *f, f->vec->data(), J, np, finite != nullptr);
    if (finite) finite->note(ok);
  }
}

// The output's tangents along `count` tangents of the input value x, no parameter moving:
// seed(k, dX) writes the k-th tangent of x (tokens, width(x)), then take(k, dZ) reads the output's
// (null where x does not reach it), both in the backend's memory. On the host the tangents run in
// parallel, one Tangent per thread, each computed the same way whichever thread runs it (work:
// the multiply-adds of one); on a GPU one after another on its stream.
template <class T, class Seed, class Take>
void input_tangents(const Graph<T>& g, int x, index_t count, index_t work, Seed&& seed, Take&& take) {
  const bool host = g.backend().host_addressable();
  const int slots = host ? parallel::num_threads() : 1;
  std::vector<Tangent<T>> tangents(static_cast<size_t>(slots));
  std::vector<BackendBuffer<T>> dX(static_cast<size_t>(slots));
  const bool parallel = host && count * work >= blockhess::detail::kParallelWorkThreshold;
  const index_t chunk = blockhess::detail::chunk_size(count, work, slots);
  blockhess::detail::parallel_for_slots(count, parallel, chunk, slots, [&](index_t k, int slot) {
    BackendBuffer<T>& in = dX[static_cast<size_t>(slot)];
    in.resize(g.backend(), g.tokens() * g.width(x));
    seed(k, in.data());
    take(k, g.jvp_input(tangents[static_cast<size_t>(slot)], x, in.data()));
  });
}

// d2 Z_o / dW_i dW_j for every output entry o: for each, the Hessian of Z_o (whose cotangent is the
// unit vector e_o) over W_i and W_j, assembled through `out` (a (P, P) target: HostHessian, or the
// GPU's DeviceHessian); then take(o, row, col, n_i, n_j) reads its (i, j) block, which starts at
// (row, col).
template <class T, class Out, class Take>
void output_hessians(Graph<T>& g, int i, int j, Out& out, Take&& take) {
  std::vector<bool> wrt(static_cast<size_t>(g.num_params()), false);
  wrt.at(static_cast<size_t>(i)) = wrt.at(static_cast<size_t>(j)) = true;
  g.select(wrt);
  try {
    g.push_factors(/*to_output=*/false);
  } catch (const FactorsDoNotReach& e) {
    throw std::invalid_argument(std::string(e.what()) +
                                "; the output Hessian is assembled from them (a pair of the last block's or a final "
                                "norm's parameters): for a lower layer use loss_hessian, exact for every layer");
  }
  const std::vector<index_t> off = g.offsets(wrt);
  const index_t ni = g.parameter(i).size(), nj = g.parameter(j).size();
  const index_t m = g.tokens() * g.width(g.output());
  Buffer<T> gZ(m, T(0));
  for (index_t o = 0; o < m; ++o) {
    gZ[o] = T(1);
    g.reverse(gZ.data());
    assemble(g, g.curvature(), off, out);
    take(o, off[static_cast<size_t>(i)], off[static_cast<size_t>(j)], ni, nj);
    gZ[o] = T(0);
  }
}

// The size of the selection {W_i, W_j} (one parameter when i == j): the P of output_hessians' target.
template <class T>
index_t pair_size(const Graph<T>& g, int i, int j) {
  return g.parameter(i).size() + (i == j ? 0 : g.parameter(j).size());
}

// The same in host memory, in the layout (tokens width(Z) n_i, n_j).
template <class T>
void output_hessian(Graph<T>& g, int i, int j, T* result) {
  const index_t P = pair_size(g, i, j);
  Buffer<T> H(P * P);
  HostHessian<T> target{H.data(), P};
  output_hessians(g, i, j, target, [&](index_t o, index_t row, index_t col, index_t ni, index_t nj) {
    for (index_t a = 0; a < ni; ++a) std::copy_n(H.data() + (row + a) * P + col, nj, result + (o * ni + a) * nj);
  });
}

}  // namespace blockhess::engine
