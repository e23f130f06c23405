// Dense Hessian assembly from a graph's factors and curvature terms (terms.hpp): each selected pair
// of parameters once, into the upper block triangle, then mirrored (symmetric bit for bit).
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <utility>
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

// The products a pooled site adds, H (upper triangle) += sum_b Jbar_b^T Omega_b Jbar_b, with
// Jbar_b = sum_t J_b,t the Jacobian of sample b's tokens at the site's value summed over tokens:
// (width, P), built from the factors (J_t[a, flat(o, r)] = vec_t[o] U_t[a, r]) a few samples at a
// time, so that the products have an inner dimension of about 128 and the scratch stays O(width P).
// rows(J, K, n) receives each chunk: H's upper triangle += J[:n]^T K[:n] (K = Omega J per sample).
template <class T, class RowsFn>
void pooled_rows(const Graph<T>& g, const PooledSite<T>& site, const std::vector<int>& pieces,
                 const std::vector<index_t>& offset, index_t P, RowsFn&& rows_fn) {
  const index_t w = g.width(site.value), L = g.tokens_per_sample(), B = g.samples();
  const index_t chunk = std::max<index_t>(1, std::min<index_t>(B, 128 / std::max<index_t>(1, w)));
  Mat<T> J(chunk * w, P), K(chunk * w, P);
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
    rows_fn(J, K, rows);
  }
}

// pooled_rows into host memory: blocks of rows of the upper triangle (the lower one is mirrored
// from it at the end).
template <class T>
void accumulate_pooled(const Graph<T>& g, const PooledSite<T>& site, const std::vector<int>& pieces,
                       const std::vector<index_t>& offset, index_t P, T* H) {
  MapM<T> Hm(H, P, P);
  pooled_rows(g, site, pieces, offset, P, [&](const Mat<T>& J, const Mat<T>& K, index_t rows) {
    const index_t band = 64, bands = (P + band - 1) / band;
    blockhess::detail::parallel_for(bands, rows * band * P / 2, [&](index_t q) {
      const index_t r0 = q * band, nr = std::min(band, P - r0);
      Hm.block(r0, r0, nr, P - r0).noalias() +=
          J.topRows(rows).middleCols(r0, nr).transpose() * K.topRows(rows).rightCols(P - r0);
    });
  });
}

// The block of H that one ordered pair of pieces owns (assemble: the upper block triangle, and one
// parameter's pieces in both orders), with what adds to it, in the order the terms come.
template <class T>
struct HessianBlock {
  struct Step {
    std::function<void(bool overwrite, bool threads)> run;
    bool covers = false;  // writes every entry of the block that the mirror reads (a diagonal term does not)
  };
  int i = -1, j = -1;
  std::vector<Step> early, late;  // before and after the pooled sites (which add to all of H at once)
  double cost = 0;                // multiply-adds, roughly: what the scheduler balances
};

// Runs each block's steps: the first step that covers the block overwrites it (no zero fill of a
// memory-bound output), a block with none is zeroed first. The blocks own disjoint entries, so
// they run at once on the thread pool, each on one thread, largest first; only a block too large
// to balance (over 1/(2 threads) of the work) runs alone on every thread. Each entry's terms are
// summed in the same order either way: the bits do not depend on the schedule.
// A target that cannot write blocks at once (one GPU stream) runs them in order, each with the
// thread pool for its per-token work.
template <class T>
void run_blocks(std::vector<HessianBlock<T>>& blocks, bool early, bool concurrent,
                const std::function<void(const HessianBlock<T>&)>& zero) {
  auto run = [&](HessianBlock<T>& b, bool threads) {
    auto& steps = early ? b.early : b.late;
    bool overwrite = early && !steps.empty() && steps.front().covers;
    if (early && !overwrite) zero(b);
    for (auto& step : steps) step.run(overwrite, threads), overwrite = false;
  };
  if (!concurrent) {
    for (auto& b : blocks) run(b, true);
    return;
  }
  std::vector<HessianBlock<T>*> order;
  double total = 0;
  for (auto& b : blocks) order.push_back(&b), total += b.cost;
  std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->cost > b->cost; });
  const int threads = parallel::num_threads();
  size_t first_shared = 0;
  while (first_shared < order.size() && order[first_shared]->cost * 2 * threads > total) run(*order[first_shared++], true);
  const index_t shared = static_cast<index_t>(order.size() - first_shared);
  blockhess::detail::parallel_for_slots(shared, total >= blockhess::detail::kParallelWorkThreshold, 1, threads,
                                        [&](index_t k) { run(*order[first_shared + static_cast<size_t>(k)], false); });
}

}  // namespace detail

// Where assemble() writes: the (P, P) matrix and the five things it does to it. This one is host
// memory (kron_sum.hpp's primitives, on the thread pool); the GPU's (cuda/'s DeviceHessian) has the
// same members over device memory. Blocks are addressed by their first row and column.
template <class T>
struct HostHessian {
  T* H = nullptr;
  index_t P = 0;
  static constexpr bool concurrent_blocks = true;  // blocks own disjoint entries: the pool runs them at once

  void begin() {}
  // Block (row, col) += sum_t u_t (x) w_t (x) Gamma_t (kron::accumulate).
  template <class GammaFn>
  void kron(index_t row, index_t col, index_t tokens, const kron::Split& si, const T* u, const kron::Split& sj,
            const T* w, GammaFn&& gamma, bool upper_only, bool overwrite, bool threads) {
    kron::accumulate<T>(tokens, si, u, sj, w, std::forward<GammaFn>(gamma), T(1), H + row * P + col, P, upper_only,
                        overwrite, threads);
  }
  // Block (row, col) += the same sum with Gamma_t = diag(D_t) (kron::accumulate_diagonal).
  void kron_diagonal(index_t row, index_t col, index_t tokens, const kron::Split& si, const T* u,
                     const kron::Split& sj, const T* w, const T* D, bool threads) {
    kron::accumulate_diagonal(tokens, si, u, sj, w, D, T(1), H + row * P + col, P, threads);
  }
  // Block (row, col), of pieces split as si and sj, = 0.
  void zero(index_t row, index_t col, const kron::Split& si, const kron::Split& sj) {
    T* base = H + row * P + col;
    for (index_t o = 0; o < si.n_vec(); ++o)
      for (index_t r = 0; r < si.n_mat(); ++r)
        for (index_t oj = 0; oj < sj.n_vec(); ++oj) std::fill_n(base + si.flat(o, r) * P + sj.flat(oj, 0), sj.n_mat(), T(0));
  }
  void pooled(const Graph<T>& g, const PooledSite<T>& site, const std::vector<int>& pieces,
              const std::vector<index_t>& offset) {
    detail::accumulate_pooled(g, site, pieces, offset, P, H);
  }
  // The upper triangle onto the lower; whether every entry is finite.
  bool mirror() { return kron::mirror_upper(H, P); }
};

// The Hessian (P x P, the selected parameters at `offset`) = the sum of the terms, written through
// `out` (HostHessian, or the GPU's DeviceHessian). Terms name pieces (a
// parameter, or one head's block of its columns: Graph::split_columns); each pair of parameters is
// written into the upper block triangle, and the pieces of one parameter in both orders (their
// columns interleave). Every term becomes steps of the blocks it writes (detail::HessianBlock).
template <class T, class Out>
void assemble(const Graph<T>& g, Terms<T> terms, const std::vector<index_t>& offset, Out& out) {
  const index_t n = g.tokens();
  std::vector<Site<T>> sites = detail::settle_sites(g, std::move(terms.sites));
  auto param = [&](int f) { return g.piece(f).param; };
  // A piece with no factor anywhere moves nothing (a key bias): its block rows stay 0.
  std::vector<int> selected, all;
  for (int f = 0; f < g.num_pieces(); ++f) {
    if (!g.piece_selected(f)) continue;
    all.push_back(f);
    bool present = false;
    for (int v = 0; v < g.num_values() && !present; ++v) present = g.factor(v, f).present;
    if (present) selected.push_back(f);
  }
  // The site every selected piece reaches (the loss's, at the output) goes first: it writes every
  // block, the others add to it.
  auto reaches_all = [&](const Site<T>& s) {
    return std::all_of(selected.begin(), selected.end(), [&](int f) { return g.factor(s.value, f).present; });
  };
  auto first = std::find_if(sites.begin(), sites.end(), reaches_all);
  if (first != sites.end()) std::rotate(sites.begin(), first, first + 1);
  auto row_of = [&](int f) { return offset[static_cast<size_t>(param(f))]; };
  // Whether the pair (fi, fj) is assembled as it stands: upper block triangle, or one parameter's
  // pieces in both orders.
  auto assembled = [&](int fi, int fj) {
    if (param(fi) != param(fj)) return param(fi) < param(fj);
    return fi == fj || g.pieces_of(param(fi)).size() > 1;
  };
  std::vector<detail::HessianBlock<T>> blocks;
  std::vector<int> block_of(static_cast<size_t>(g.num_pieces() * g.num_pieces()), -1);
  for (int i : all)
    for (int j : all)
      if (assembled(i, j)) {
        block_of[static_cast<size_t>(i * g.num_pieces() + j)] = static_cast<int>(blocks.size());
        blocks.emplace_back();
        blocks.back().i = i, blocks.back().j = j;
      }
  const bool pooled = !terms.pooled.empty();
  auto add_step = [&](int fi, int fj, bool covers, double work, std::function<void(bool, bool)> run) {
    detail::HessianBlock<T>& b = blocks[static_cast<size_t>(block_of[static_cast<size_t>(fi * g.num_pieces() + fj)])];
    (pooled && !covers ? b.late : b.early).push_back({std::move(run), covers});
    b.cost += work;
  };
  auto size_of = [&](int f) { return static_cast<double>(g.split_of(f, true).size()); };

  for (const Site<T>& s : sites)
    for (int i : selected)
      for (int j : selected) {
        if (!assembled(i, j)) continue;
        const Factor<T>&fi = g.factor(s.value, i), &fj = g.factor(s.value, j);
        if (!fi.present || !fj.present) continue;
        add_step(i, j, true, n * size_of(i) * size_of(j), [&, i, j, &fi = fi, &fj = fj](bool overwrite, bool threads) {
          out.kron(row_of(i), row_of(j), n, fi.split, fi.vec->data(), fj.split, fj.vec->data(),
                   detail::sandwich(fi, fj, s), i == j, overwrite, threads);
        });
      }
  for (const KronTerm<T>& k : terms.kron) {
    if (!g.piece_selected(k.i) || !g.piece_selected(k.j)) continue;
    const double work = n * size_of(k.i) * size_of(k.j);
    if (assembled(k.i, k.j) || k.i == k.j)
      add_step(k.i, k.j, true, work, [&](bool overwrite, bool threads) {
        out.kron(row_of(k.i), row_of(k.j), n, k.si, k.u, k.sj, k.w, k.gamma, k.symmetric, overwrite, threads);
      });
    if (k.i != k.j && (assembled(k.j, k.i) || param(k.i) == param(k.j)))  // the pair's upper block is (j, i)
      add_step(k.j, k.i, true, work, [&](bool overwrite, bool threads) {
        const index_t ri = k.si.n_mat(), rj = k.sj.n_mat();
        auto transposed = [&k, ri, rj](index_t t, T* G_t) {
          Mat<T> G(ri, rj);
          k.gamma(t, G.data());
          MapM<T>(G_t, rj, ri) = G.transpose();
        };
        out.kron(row_of(k.j), row_of(k.i), n, k.sj, k.w, k.si, k.u, transposed, false, overwrite, threads);
      });
  }
  for (const DiagonalTerm<T>& k : terms.diagonal) {
    if (!g.piece_selected(k.i) || !g.piece_selected(k.j)) continue;
    const double work = n * size_of(k.i) * size_of(k.j) / static_cast<double>(std::max<index_t>(1, k.si.n_mat()));
    if (assembled(k.i, k.j) || k.i == k.j)
      add_step(k.i, k.j, false, work, [&](bool, bool threads) {
        out.kron_diagonal(row_of(k.i), row_of(k.j), n, k.si, k.u, k.sj, k.w, k.D, threads);
      });
    if (k.i != k.j && (assembled(k.j, k.i) || param(k.i) == param(k.j)))
      add_step(k.j, k.i, false, work, [&](bool, bool threads) {
        out.kron_diagonal(row_of(k.j), row_of(k.i), n, k.sj, k.w, k.si, k.u, k.D, threads);
      });
  }

  auto zero = [&](const detail::HessianBlock<T>& b) {
    out.zero(row_of(b.i), row_of(b.j), g.split_of(b.i, true), g.split_of(b.j, true));
  };
  out.begin();
  detail::run_blocks<T>(blocks, true, Out::concurrent_blocks, zero);
  if (pooled) {
    for (const PooledSite<T>& s : terms.pooled) out.pooled(g, s, selected, offset);
    detail::run_blocks<T>(blocks, false, Out::concurrent_blocks, zero);
  }
  if (!out.mirror())  // checks every entry as it mirrors: no extra pass over H
    throw non_finite_error("block: the assembled Hessian (a sum of products of finite factors) is not finite "
                           "(Inf or NaN) although every input is: the inputs drive it past the float range; "
                           "rescale them (weights or inputs of smaller magnitude)");
}

// Into host memory H (P x P).
template <class T>
void assemble(const Graph<T>& g, Terms<T> terms, const std::vector<index_t>& offset, index_t P, T* H) {
  HostHessian<T> out{H, P};
  assemble(g, std::move(terms), offset, out);
}

#ifdef BLOCKHESS_COMPILED
// Compiled once per instruction-set level with the kernels (cpp/compiled/assembly.cpp): the
// per-token products of the assembly profit from wider vector units as much as the GEMMs do.
extern template void assemble<float, HostHessian<float>>(const Graph<float>&, Terms<float>,
                                                         const std::vector<index_t>&, HostHessian<float>&);
extern template void assemble<double, HostHessian<double>>(const Graph<double>&, Terms<double>,
                                                           const std::vector<index_t>&, HostHessian<double>&);
#endif

}  // namespace blockhess::engine
