// The diagonal of the Hessian that assemble() would write, from the same terms and factors, with no
// block of it formed: each term contributes to an entry (p, p) only where both of its sides name the
// same piece (a parameter, or one head's block of its columns) and the same flat index.
//
// For a term sum_t u_t (x) w_t (x) Gamma_t on pieces i = j, the entry at flat index k is
//     sum_t u_t[o_i(k)] w_t[o_j(k)] Gamma_t[r_i(k), r_j(k)],
// (o, r) the vector and matrix indices of k on each side (kron::Split). A site needs only the
// diagonal of U_t^T Omega_t U_t (no r x r Gamma); a pooled site the diagonal of Jbar^T Omega_b Jbar,
// a few columns of the token-summed Jacobian at a time. Cost: that of the factors, O(tokens w^2 n)
// per piece, and memory O(tokens n_mat) beside them: traces and diagonals at sizes where no block
// of the Hessian fits.
#pragma once

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "blockhess/eigen.hpp"
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/terms.hpp"
#include "blockhess/parallel.hpp"

namespace blockhess::engine {

namespace detail {

// (vector index, matrix index) of a flat parameter index k (the inverse of kron::Split::flat).
inline void unflat(const kron::Split& s, index_t k, index_t& o, index_t& r) {
  const index_t x = k - s.offset, q = x / s.row_stride(), m = x % s.row_stride();
  if (s.vec_on_first) o = q, r = m;
  else r = q, o = m;
}

// C_t = G_t^T Omega_t G_t for every token (tokens, cols, cols): what a site makes of a factor's
// moving part, shared by the pieces whose G_t are alike (one attention head's parameters).
template <class T>
std::shared_ptr<const Buffer<T>> site_core(const Factor<T>& f, const Site<T>& site, index_t tokens) {
  const index_t c = f.cols();
  auto core = std::make_shared<Buffer<T>>(static_cast<size_t>(tokens * c * c));
  blockhess::detail::parallel_for(tokens, f.width * c * (f.width + c), [&](index_t t) {
    moving_sandwich(f, f, site, t, core->data() + t * c * c);
  });
  return core;
}

// gamma[t, r] = (U_t^T Omega_t U_t)[r, r] for every token: the diagonal of a site's Gamma. With a
// right factor, the columns of R_t^T C_t R_t, from C_t (site_core).
template <class T>
Buffer<T> site_gamma_diagonal(const Factor<T>& f, const Site<T>& site, index_t tokens, const Buffer<T>* core) {
  const index_t w = f.width, nr = f.n_mat();
  Buffer<T> gamma(static_cast<size_t>(tokens * nr));
  if (f.right) {
    const index_t c = f.cols();
    blockhess::detail::parallel_for(tokens, c * c * nr, [&](index_t t) {
      const MapC<T> R = f.right_t(t);
      const Mat<T> CR = MapC<T>(core->data() + t * c * c, c, c) * R;
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(gamma.data() + t * nr, nr) = R.cwiseProduct(CR).colwise().sum();
    });
    return gamma;
  }
  blockhess::detail::parallel_for(tokens, w * w * nr, [&](index_t t) {
    T* out = gamma.data() + t * nr;
    const T* omega = site.omega->data() + (site.diagonal ? t * w : t * w * w);
    auto omega_aa = [&](index_t a) { return site.diagonal ? omega[a] : omega[a * w + a]; };
    if (f.form != Form::dense) {  // U_t = I or diag(delta_t): Gamma_t[r, r] = delta_r^2 Omega_t[r, r]
      for (index_t r = 0; r < nr; ++r) {
        const T delta = f.form == Form::identity ? T(1) : f.diagonal_t(t)[r];
        out[r] = delta * delta * omega_aa(r);
      }
      return;
    }
    const ColMap<T> U = f.dense(t);
    if (site.diagonal) {
      const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> om(omega, w);
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(out, nr) = om.transpose() * U.cwiseAbs2();
      return;
    }
    const Mat<T> OU = MapC<T>(omega, w, w) * U;
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(out, nr) = U.cwiseProduct(OU).colwise().sum();
  });
  return gamma;
}

// diag[offset + flat(o, r)] += M(o, r) for a (n_vec, n_mat) matrix M of one piece.
template <class T>
void scatter_piece(const kron::Split& s, const Mat<T>& M, T* diag) {
  for (index_t o = 0; o < M.rows(); ++o)
    for (index_t r = 0; r < M.cols(); ++r) diag[s.flat(o, r)] += M(o, r);
}

// A site's share: M = (vec o vec)^T gamma, one GEMM over tokens.
template <class T>
void site_diagonal(const Factor<T>& f, const Site<T>& site, index_t tokens, const Buffer<T>* core, T* diag) {
  const Buffer<T> gamma = site_gamma_diagonal(f, site, tokens, core);
  const index_t nv = f.split.n_vec(), nr = f.n_mat();
  const Mat<T> v2 = MapC<T>(f.vec->data(), tokens, nv).cwiseAbs2();
  const Mat<T> M = v2.transpose() * MapC<T>(gamma.data(), tokens, nr);
  scatter_piece(f.split, M, diag);
}

// A bilinear term on one piece: its Gammas a chunk of tokens at a time, then every flat index of
// the piece (rows of the piece in parallel, each written by one thread).
template <class T, class GammaFn>
void term_diagonal(index_t tokens, const kron::Split& si, const T* u, const kron::Split& sj, const T* w,
                   GammaFn&& gamma, bool diagonal_gamma, T* diag) {
  const index_t nvi = si.n_vec(), nri = si.n_mat(), nvj = sj.n_vec(), nrj = sj.n_mat();
  const index_t gsize = diagonal_gamma ? nri : nri * nrj;
  const index_t chunk = std::max<index_t>(1, std::min<index_t>(tokens, (index_t(1) << 22) / std::max<index_t>(1, gsize)));
  Buffer<T> G(static_cast<size_t>(chunk * gsize));
  for (index_t t0 = 0; t0 < tokens; t0 += chunk) {
    const index_t nt = std::min(chunk, tokens - t0);
    blockhess::detail::parallel_for(nt, gsize, [&](index_t k) { gamma(t0 + k, G.data() + k * gsize); });
    blockhess::detail::parallel_for(nvi, nt * nri, [&](index_t oi) {
      for (index_t ri = 0; ri < nri; ++ri) {
        const index_t flat = si.flat(oi, ri);
        index_t oj = 0, rj = 0;
        unflat(sj, flat, oj, rj);
        if (oj >= nvj || rj >= nrj || (diagonal_gamma && rj != ri)) continue;
        T sum = 0;
        for (index_t k = 0; k < nt; ++k) {
          const T g = diagonal_gamma ? G[k * gsize + ri] : G[k * gsize + ri * nrj + rj];
          sum += u[(t0 + k) * nvi + oi] * w[(t0 + k) * nvj + oj] * g;
        }
        diag[flat] += sum;
      }
    });
  }
}

// A pooled site's share: for each vector index o, the columns Jbar_b[:, flat(o, .)] =
// sum_t vec_t[o] U_t of each sample b, then diag += colsum(Jbar o (Omega_b Jbar)).
template <class T>
void pooled_diagonal(const Graph<T>& g, const Factor<T>& f, const PooledSite<T>& site, T* diag) {
  const index_t w = f.width, nv = f.split.n_vec(), nr = f.n_mat(), L = g.tokens_per_sample();
  Mat<T> M = Mat<T>::Zero(nv, nr);
  for (index_t b = 0; b < g.samples(); ++b) {
    std::vector<Mat<T>> U(static_cast<size_t>(L));
    for (index_t t = 0; t < L; ++t) f.materialise(b * L + t, U[static_cast<size_t>(t)]);
    const MapC<T> omega(site.omega->data() + b * w * w, w, w);
    blockhess::detail::parallel_for(nv, L * w * nr + w * w * nr, [&](index_t o) {
      Mat<T> J = Mat<T>::Zero(w, nr);
      for (index_t t = 0; t < L; ++t) J += f.vec->data()[(b * L + t) * nv + o] * U[static_cast<size_t>(t)];
      M.row(o) += J.cwiseProduct(omega * J).colwise().sum();
    });
  }
  scatter_piece(f.split, M, diag);
}

}  // namespace detail

// diag (the parameters at `offset`) += the diagonal of assemble(g, terms, ...) on the selected ones.
template <class T>
void add_diagonal(const Graph<T>& g, Terms<T> terms, const std::vector<index_t>& offset, T* diag) {
  const index_t n = g.tokens();
  auto at = [&](int f) { return diag + offset[static_cast<size_t>(g.piece(f).param)]; };
  const std::vector<Site<T>> sites = detail::settle_sites(g, std::move(terms.sites));
  for (const Site<T>& s : sites) {
    std::vector<std::pair<const Factor<T>*, std::shared_ptr<const Buffer<T>>>> cores;  // per distinct G_t
    for (int f = 0; f < g.num_pieces(); ++f) {
      const Factor<T>& fac = g.factor(s.value, f);
      if (!g.piece_selected(f) || !fac.present) continue;
      std::shared_ptr<const Buffer<T>> core;
      if (fac.right) {
        for (const auto& [alike, c] : cores)
          if (alike->moves_like(fac)) core = c;
        if (!core) cores.emplace_back(&fac, core = detail::site_core(fac, s, n));
      }
      detail::site_diagonal(fac, s, n, core.get(), at(f));
    }
  }
  for (int f = 0; f < g.num_pieces(); ++f) {
    if (!g.piece_selected(f)) continue;
    for (const PooledSite<T>& s : terms.pooled)
      if (g.factor(s.value, f).present) detail::pooled_diagonal(g, g.factor(s.value, f), s, at(f));
  }
  for (const KronTerm<T>& k : terms.kron) {
    if (k.i != k.j || !g.piece_selected(k.i)) continue;
    if (k.symmetric && k.gamma_diagonal) detail::term_diagonal(n, k.si, k.u, k.sj, k.w, k.gamma_diagonal, true, at(k.i));
    else detail::term_diagonal(n, k.si, k.u, k.sj, k.w, k.gamma, false, at(k.i));
  }
  for (const DiagonalTerm<T>& k : terms.diagonal) {
    if (k.i != k.j || !g.piece_selected(k.i)) continue;
    const index_t r = k.si.n_mat();
    auto gamma = [&k, r](index_t t, T* out) {
      for (index_t q = 0; q < r; ++q) out[q] = k.D ? k.D[t * r + q] : T(1);
    };
    detail::term_diagonal(n, k.si, k.u, k.sj, k.w, gamma, true, at(k.i));
  }
}

// The sites above a token-local cut (Graph::token_local_cuts: every node after `cut` is token-local),
// the nodes' there where `functional` and the head's `outer` sites, as one site at the cut's value c:
//     Omega~_t = sum_s M_s,t^T Omega_s,t M_s,t,
// M_s,t the Jacobian of site s's value on c's row t, read off a probe factor (G_t = I at c, in piece
// 0's slot with nothing selected) pushed through the nodes after the cut. A parameter of a node up
// to the cut moves those values only through c, by M_s,t U_t with U_t its factor at c, so its share
// of every site above is U_t^T Omega~_t U_t (docs/derivation.md §4.5): one site at c in place of
// its factors pushed through every node above. Leaves no factors behind.
template <class T>
Site<T> site_at_cut(Graph<T>& g, int cut, bool functional, const std::vector<Site<T>>& outer) {
  const index_t n = g.tokens();
  const int c = g.nodes()[static_cast<size_t>(cut)]->output;
  const index_t w = g.width(c);
  g.select(std::vector<bool>(static_cast<size_t>(g.num_params()), false));
  std::vector<Site<T>> above = functional ? g.curvature_after(cut).sites : std::vector<Site<T>>{};
  above.insert(above.end(), outer.begin(), outer.end());
  g.push_factors_through(-1);
  g.set_factor(c, 0, entering<T>(kron::Split{1, w, true}, filled(g.backend(), n, T(1)), w));
  g.push_factors_after(cut);
  auto omega = std::make_shared<Buffer<T>>(static_cast<size_t>(n * w * w), T(0));
  for (const Site<T>& s : detail::settle_sites(g, std::move(above))) {
    const Factor<T>& probe = g.factor(s.value, 0);
    if (!probe.present) throw std::logic_error("engine: a site above a token-local cut that the cut does not reach");
    blockhess::detail::parallel_for(n, 2 * w * probe.width * (w + probe.width), [&](index_t t) {
      Mat<T> C(w, w);
      detail::moving_sandwich(probe, probe, s, t, C.data());
      MapM<T>(omega->data() + t * w * w, w, w) += C;
    });
  }
  g.clear_factors();
  return Site<T>{c, std::move(omega), false};
}

#ifdef BLOCKHESS_COMPILED
// Compiled once per instruction-set level with the kernels (cpp/compiled/assembly.cpp).
extern template void add_diagonal<float>(const Graph<float>&, Terms<float>, const std::vector<index_t>&, float*);
extern template void add_diagonal<double>(const Graph<double>&, Terms<double>, const std::vector<index_t>&, double*);
#endif

}  // namespace blockhess::engine
