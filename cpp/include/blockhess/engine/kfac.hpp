// K-FAC's Kronecker factors of the weights of a wired graph, as the approximation is defined for
// weights shared over a sequence (Eschenhagen et al., 2023; the definition curvlinops implements),
// with the type-2 Fisher: the head's exact curvature, backpropagated one column of its square root
// at a time (Head::root_column). For a weight W (rows x cols) applied to every token, out_t = in_t W:
//   expand:  A = 1/(B T) sum_t in_t in_t^T,             G = sum_c sum_t g_t,c g_t,c^T
//   reduce:  A = 1/B sum_b mean_t(in_b,t) mean_t(...)^T, G = sum_c sum_b (sum_t g_b,t,c)(...)^T
// with g_t,c the cotangent of out_t in the reverse pass seeded by column c (every loss term's column
// c at once), T the tokens per sample. The Gauss-Newton block of W, in W's row-major vec order, is
// then approximated by A (x) G. With several loss terms per sample (a per-token loss) the seed holds
// every term's column c at once, so G also carries products of different terms' columns that
// attention brings together, which the exact Gauss-Newton matrix has not: K-FAC as curvlinops
// computes it. With one term per sample (a pooled or class-token classifier) there are none.
// A bias is a weight whose input is 1 (A = [1], curvlinops' separate bias); a table looked up by
// id (an embedding's rows, learned positions, a class token) a weight whose input is the id's
// one-hot (LinearUse::ids). An embedding tied to the LM head has the factors of its use as the
// head's weight, as curvlinops defines them (it sees the head's Linear, not the lookup).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/eigen.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/kronecker_factors.hpp"
#include "blockhess/engine/loss.hpp"

namespace blockhess::engine {

namespace detail {

// The rows of a (tokens, width) array, or (reduce) each sample's rows combined into one: their
// mean (an input's) or sum (a cotangent's).
template <class T>
Mat<T> kfac_rows(const T* rows, index_t B, index_t L, index_t width, bool reduce, bool mean) {
  const MapC<T> all(rows, B * L, width);
  if (!reduce) return all;
  Mat<T> out = Mat<T>::Zero(B, width);
  for (index_t b = 0; b < B; ++b) out.row(b) = all.middleRows(b * L, L).colwise().sum();
  if (mean) out /= static_cast<T>(L);
  return out;
}

// A of a table looked up by id (LinearUse::ids): token t's input the one-hot of ids[t], none
// where -1. expand: the ids' frequencies on the diagonal; reduce: each sample's frequencies, their
// mean outer product.
template <class T>
Buffer<T> lookup_covariance(const std::int64_t* ids, index_t B, index_t L, index_t rows, bool reduce) {
  Buffer<T> A(static_cast<size_t>(rows * rows), T(0));
  if (!reduce) {
    const T share = T(1) / static_cast<T>(B * L);
    for (index_t t = 0; t < B * L; ++t)
      if (ids[t] >= 0) A[static_cast<size_t>(ids[t] * rows + ids[t])] += share;
    return A;
  }
  Mat<T> frequencies = Mat<T>::Zero(B, rows);
  for (index_t t = 0; t < B * L; ++t)
    if (ids[t] >= 0) frequencies(t / L, ids[t]) += T(1) / static_cast<T>(L);
  MapM<T>(A.data(), rows, rows).noalias() = frequencies.transpose() * frequencies / static_cast<T>(B);
  return A;
}

}  // namespace detail

// The factors of every selected weight that the graph applies to every token (Graph::linear_use);
// the graph's forward pass done. Runs the loss's reverse pass, then one more per column of the
// head's square root. The inputs' side is A and the outputs' side G, except for a weight applied
// transposed (a tied LM head: its rows are the outputs), where they trade places.
template <class T>
std::vector<KroneckerFactors<T>> kfac_factors(Graph<T>& g, Head<T>& head, const std::vector<bool>& wrt, bool reduce) {
  reverse_loss(g, head);
  const index_t B = g.samples(), L = g.tokens_per_sample(), n = g.tokens();
  std::vector<KroneckerFactors<T>> out;
  std::vector<char> transposed;
  auto outputs_side = [&](KroneckerFactors<T>& f, bool t) -> Buffer<T>& { return t ? f.A : f.G; };
  for (int p = 0; p < g.num_params(); ++p) {
    const LinearUse<T> use = g.linear_use(p);
    if (!wrt.at(static_cast<size_t>(p)) || !use.cotangents) continue;
    KroneckerFactors<T> f;
    f.param = p, f.rows = g.parameter(p).rows, f.cols = g.parameter(p).cols;
    const index_t in_width = use.transposed ? f.cols : f.rows, out_width = use.transposed ? f.rows : f.cols;
    Buffer<T>& inputs_side = use.transposed ? f.G : f.A;
    if (use.ids) {
      inputs_side = detail::lookup_covariance<T>(use.ids, B, L, in_width, reduce);
    } else if (use.inputs) {
      const Mat<T> x = detail::kfac_rows(use.inputs, B, L, in_width, reduce, /*mean=*/true);
      inputs_side.resize(static_cast<size_t>(in_width * in_width));
      MapM<T>(inputs_side.data(), in_width, in_width).noalias() = x.transpose() * x / static_cast<T>(x.rows());
    } else {
      inputs_side.assign(1, T(1));  // a bias: (1, cols), its input 1
    }
    outputs_side(f, use.transposed).assign(static_cast<size_t>(out_width * out_width), T(0));
    out.push_back(std::move(f));
    transposed.push_back(use.transposed);
  }
  const index_t width = g.width(g.output());
  Buffer<T> seed(static_cast<size_t>(n * width));
  for (index_t c = 0; c < head.root_columns(g); ++c) {
    head.root_column(g, c, seed.data());
    g.reverse(seed.data());
    for (size_t k = 0; k < out.size(); ++k) {
      KroneckerFactors<T>& f = out[k];
      const index_t out_width = transposed[k] ? f.rows : f.cols;
      const Mat<T> gy = detail::kfac_rows(g.linear_use(f.param).cotangents, B, L, out_width, reduce, /*mean=*/false);
      MapM<T>(outputs_side(f, transposed[k]).data(), out_width, out_width).noalias() += gy.transpose() * gy;
    }
  }
  return out;
}

}  // namespace blockhess::engine
