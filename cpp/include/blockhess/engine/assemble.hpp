// Dense Hessian assembly from a graph's factors and curvature terms (terms.hpp): each selected pair
// of parameters once, into the upper block triangle, then mirrored (symmetric bit for bit).
#pragma once

#include <algorithm>
#include <map>
#include <vector>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/terms.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/kron_sum.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::engine {

namespace detail {

// Moves every site down through the token-local, parameter-free nodes that produced its value
// (a site at a LayerNorm's output is J^T Omega J at its input), then sums the sites that meet at
// one value: each pair of parameters is then assembled once per value.
// A diagonal site as a dense one (before it is moved or merged with a dense one).
template <class T>
Site<T> densified(const Site<T>& s, index_t tokens, index_t width) {
  if (!s.diagonal) return s;
  auto dense = std::make_shared<Buffer<T>>(static_cast<size_t>(tokens * width * width), T(0));
  for (index_t t = 0; t < tokens; ++t)
    for (index_t a = 0; a < width; ++a) (*dense)[(t * width + a) * width + a] = (*s.omega)[t * width + a];
  return Site<T>{s.value, std::move(dense), false};
}

template <class T>
std::vector<Site<T>> settle_sites(const Graph<T>& g, std::vector<Site<T>> sites) {
  const index_t n = g.tokens();
  std::map<int, Site<T>> at;
  for (Site<T> s : sites) {
    const Node<T>* node = g.producer(s.value);
    while (node && node->pulls_sites()) {
      s = densified(s, n, g.width(s.value));
      const int in = node->inputs[0];
      const index_t w_out = g.width(s.value), w_in = g.width(in);
      auto pulled = std::make_shared<Buffer<T>>(static_cast<size_t>(n * w_in * w_in));
      const T* omega = s.omega->data();
      blockhess::detail::parallel_for(n, 2 * w_in * w_out * (w_in + w_out), [&](index_t t) {
        node->pull_site(g, t, omega + t * w_out * w_out, pulled->data() + t * w_in * w_in);
      });
      s = Site<T>{in, std::move(pulled), false};
      node = g.producer(s.value);
    }
    auto found = at.find(s.value);
    if (found == at.end()) {
      at.emplace(s.value, s);  // shares the buffer: copied only if another site joins it
      continue;
    }
    Site<T>& merged = found->second;
    if (merged.diagonal != s.diagonal) merged = densified(merged, n, g.width(s.value)), s = densified(s, n, g.width(s.value));
    auto sum = std::make_shared<Buffer<T>>(*merged.omega);
    for (size_t k = 0; k < sum->size(); ++k) (*sum)[k] += (*s.omega)[k];
    merged.omega = std::move(sum);
  }
  std::vector<Site<T>> settled;
  for (auto& [value, site] : at) settled.push_back(site);
  return settled;
}

// C_t = G_i,t^T Omega_t G_j,t (factor.hpp's moving parts), skipping the products with an identity
// factor. A diagonal Omega_t (mse's outer site, a smooth activation's) with an identity or diagonal
// G only scales rows or columns: nothing is materialised.
template <class T>
void moving_sandwich(const Factor<T>& fi, const Factor<T>& fj, const Site<T>& site, index_t t, T* out) {
  const index_t w = fi.width, ri = fi.cols(), rj = fj.cols();
  MapM<T> G(out, ri, rj);
  auto scale = [t](const Factor<T>& f, index_t k) { return f.form == Form::identity ? T(1) : f.diagonal_t(t)[k]; };
  if (site.diagonal) {
    const T* om = site.omega->data() + t * w;
    const bool di = fi.form != Form::dense, dj = fj.form != Form::dense;
    if (di && dj) {  // both identity or diagonal: ri = rj = w
      G.setZero();
      for (index_t k = 0; k < w; ++k) G(k, k) = scale(fi, k) * om[k] * scale(fj, k);
    } else if (di) {  // diag(s_i om) G_j: G_j's rows scaled
      const ColMap<T> Uj = fj.dense(t);
      for (index_t a = 0; a < w; ++a) G.row(a) = (scale(fi, a) * om[a]) * Uj.row(a);
    } else if (dj) {  // G_i^T diag(om s_j): G_i^T's columns scaled
      const ColMap<T> Ui = fi.dense(t);
      for (index_t b = 0; b < w; ++b) G.col(b) = Ui.row(b).transpose() * (om[b] * scale(fj, b));
    } else {
      const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> omega(om, w);
      G.noalias() = fi.dense(t).transpose() * omega.asDiagonal() * fj.dense(t);
    }
    return;
  }
  ColMat<T> Ui, Uj;
  if (fi.form == Form::diagonal) fi.materialise_moving(t, Ui);
  if (fj.form == Form::diagonal) fj.materialise_moving(t, Uj);
  const ColMap<T> Ui_map(fi.form == Form::dense ? fi.dense_t(t) : Ui.data(), w, ri);
  const ColMap<T> Uj_map(fj.form == Form::dense ? fj.dense_t(t) : Uj.data(), w, rj);
  const MapC<T> O(site.omega->data() + t * w * w, w, w);
  if (fi.form == Form::identity && fj.form == Form::identity) G = O;
  else if (fi.form == Form::identity) G.noalias() = O * Uj_map;
  else if (fj.form == Form::identity) G.noalias() = Ui_map.transpose() * O;
  else G.noalias() = Ui_map.transpose() * (O * Uj_map);
}

// Gamma_t = U_i,t^T Omega_t U_j,t = R_i,t^T C_t R_j,t (an absent R_t is the identity).
template <class T>
auto sandwich(const Factor<T>& fi, const Factor<T>& fj, const Site<T>& site) {
  return [&fi, &fj, &site](index_t t, T* out) {
    if (!fi.right && !fj.right) return moving_sandwich(fi, fj, site, t, out);
    Mat<T> C(fi.cols(), fj.cols());
    moving_sandwich(fi, fj, site, t, C.data());
    MapM<T> G(out, fi.n_mat(), fj.n_mat());
    if (fi.right && fj.right) G.noalias() = fi.right_t(t).transpose() * (C * fj.right_t(t));
    else if (fi.right) G.noalias() = fi.right_t(t).transpose() * C;
    else G.noalias() = C * fj.right_t(t);
  };
}

// H (upper triangle) += sum_b Jbar_b^T Omega_b Jbar_b for a pooled site, Jbar_b = sum_t J_b,t the
// Jacobian of sample b's tokens at the site's value summed over tokens: (width, P), built from the
// factors (J_t[a, flat(o, r)] = vec_t[o] U_t[a, r]) a few samples at a time, so that the products
// have an inner dimension of about 128 and the scratch stays O(width P).
template <class T>
void accumulate_pooled(const Graph<T>& g, const PooledSite<T>& site, const std::vector<int>& pieces,
                       const std::vector<index_t>& offset, index_t P, T* H) {
  const index_t w = g.width(site.value), L = g.tokens_per_sample(), B = g.samples();
  const index_t chunk = std::max<index_t>(1, std::min<index_t>(B, 128 / std::max<index_t>(1, w)));
  Mat<T> J(chunk * w, P), K(chunk * w, P);
  MapM<T> Hm(H, P, P);
  for (index_t b0 = 0; b0 < B; b0 += chunk) {
    const index_t nb = std::min(chunk, B - b0), rows = nb * w;
    J.topRows(rows).setZero();
    for (int f : pieces) {
      const Factor<T>& fac = g.factor(site.value, f);
      if (!fac.present) continue;
      const index_t base = offset[static_cast<size_t>(g.piece(f).param)], no = fac.split.n_vec(), nr = fac.n_mat();
      blockhess::detail::parallel_for(nb, L * w * no * nr, [&](index_t k) {
        Mat<T> U;
        for (index_t t = (b0 + k) * L; t < (b0 + k + 1) * L; ++t) {
          fac.materialise(t, U);
          const T* v = fac.vec->data() + t * no;
          for (index_t a = 0; a < w; ++a)
            for (index_t o = 0; o < no; ++o) {
              const T vo = v[o];
              for (index_t r = 0; r < nr; ++r) J(k * w + a, base + fac.split.flat(o, r)) += vo * U(a, r);
            }
        }
      });
    }
    for (index_t k = 0; k < nb; ++k)
      K.middleRows(k * w, w).noalias() = MapC<T>(site.omega->data() + (b0 + k) * w * w, w, w) * J.middleRows(k * w, w);
    // Blocks of rows of the upper triangle (the lower one is mirrored from it at the end).
    const index_t band = 64, bands = (P + band - 1) / band;
    blockhess::detail::parallel_for(bands, rows * band * P / 2, [&](index_t q) {
      const index_t r0 = q * band, nr = std::min(band, P - r0);
      Hm.block(r0, r0, nr, P - r0).noalias() +=
          J.topRows(rows).middleCols(r0, nr).transpose() * K.topRows(rows).rightCols(P - r0);
    });
  }
}

}  // namespace detail

// H (P x P, the selected parameters at `offset`) = the sum of the terms. Terms name pieces (a
// parameter, or one head's block of its columns: Graph::split_columns); each pair of parameters is
// written into the upper block triangle, and the pieces of one parameter in both orders (their
// columns interleave). The first site that every selected piece reaches overwrites H (no zero fill
// of a memory-bound output); the rest add.
template <class T>
void assemble(const Graph<T>& g, Terms<T> terms, const std::vector<index_t>& offset, index_t P, T* H) {
  const index_t n = g.tokens();
  std::vector<Site<T>> sites = detail::settle_sites(g, std::move(terms.sites));
  auto param = [&](int f) { return g.piece(f).param; };
  // A piece with no factor anywhere moves nothing (a key bias): its rows and columns are 0.
  std::vector<int> selected, inert;
  for (int f = 0; f < g.num_pieces(); ++f) {
    if (!g.piece_selected(f)) continue;
    bool present = false;
    for (int v = 0; v < g.num_values() && !present; ++v) present = g.factor(v, f).present;
    (present ? selected : inert).push_back(f);
  }
  auto reaches_all = [&](const Site<T>& s) {
    return std::all_of(selected.begin(), selected.end(), [&](int f) { return g.factor(s.value, f).present; });
  };
  auto first = std::find_if(sites.begin(), sites.end(), reaches_all);
  if (first != sites.end()) std::rotate(sites.begin(), first, first + 1);
  else std::fill_n(H, P * P, T(0));
  bool overwrite = first != sites.end();
  if (overwrite)
    for (int f : inert) {
      const kron::Split piece = g.split_of(f, true);
      for (index_t r = 0; r < piece.n_vec(); ++r)
        for (index_t c = 0; c < piece.n_mat(); ++c) {
          const index_t k = offset[static_cast<size_t>(param(f))] + piece.flat(r, c);
          std::fill_n(H + k * P, P, T(0));
          for (index_t i = 0; i < P; ++i) H[i * P + k] = T(0);
        }
    }
  auto block = [&](int fi, int fj) {
    return H + offset[static_cast<size_t>(param(fi))] * P + offset[static_cast<size_t>(param(fj))];
  };
  // Whether the pair (fi, fj) is assembled as it stands: upper block triangle, or one parameter's
  // pieces in both orders.
  auto assembled = [&](int fi, int fj) {
    if (param(fi) != param(fj)) return param(fi) < param(fj);
    return fi == fj || g.pieces_of(param(fi)).size() > 1;
  };

  for (const Site<T>& s : sites) {
    for (int i : selected)
      for (int j : selected) {
        if (!assembled(i, j)) continue;
        const Factor<T>&fi = g.factor(s.value, i), &fj = g.factor(s.value, j);
        if (!fi.present || !fj.present) continue;
        kron::accumulate(n, fi.split, fi.vec->data(), fj.split, fj.vec->data(), detail::sandwich(fi, fj, s),
                         T(1), block(i, j), P, i == j, overwrite);
      }
    overwrite = false;
  }
  for (const KronTerm<T>& k : terms.kron) {
    if (!g.piece_selected(k.i) || !g.piece_selected(k.j)) continue;
    const index_t ri = k.si.n_mat(), rj = k.sj.n_mat();
    auto transposed = [&k, ri, rj](index_t t, T* out) {
      Mat<T> G(ri, rj);
      k.gamma(t, G.data());
      MapM<T>(out, rj, ri) = G.transpose();
    };
    if (assembled(k.i, k.j) || k.i == k.j) kron::accumulate(n, k.si, k.u, k.sj, k.w, k.gamma, T(1), block(k.i, k.j), P, k.symmetric);
    if (k.i != k.j && (assembled(k.j, k.i) || param(k.i) == param(k.j)))  // the pair's upper block is (j, i)
      kron::accumulate(n, k.sj, k.w, k.si, k.u, transposed, T(1), block(k.j, k.i), P);
  }
  for (const PooledSite<T>& s : terms.pooled) detail::accumulate_pooled(g, s, selected, offset, P, H);
  for (const DiagonalTerm<T>& k : terms.diagonal) {
    if (!g.piece_selected(k.i) || !g.piece_selected(k.j)) continue;
    if (assembled(k.i, k.j) || k.i == k.j) kron::accumulate_diagonal(n, k.si, k.u, k.sj, k.w, k.D, T(1), block(k.i, k.j), P);
    if (k.i != k.j && (assembled(k.j, k.i) || param(k.i) == param(k.j)))
      kron::accumulate_diagonal(n, k.sj, k.w, k.si, k.u, k.D, T(1), block(k.j, k.i), P);
  }
  if (!kron::mirror_upper(H, P))  // checks every entry as it mirrors: no extra pass over H
    throw non_finite_error("block: the assembled Hessian (a sum of products of finite factors) is not finite "
                           "(Inf or NaN) although every input is: the inputs drive it past the float range; "
                           "rescale them (weights or inputs of smaller magnitude)");
}

}  // namespace blockhess::engine
