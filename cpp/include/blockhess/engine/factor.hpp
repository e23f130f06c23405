// Per-token tangent factors: how a value of the block moves with one parameter.
//
// Inside a block every parameter's first derivative factorises per token t (docs/derivation.md
// §4.2): the tangent of a value's row t is U_t (vec_t (x) dW), a small matrix U_t applied to the
// parameter's tangent contracted with a vector vec_t on one of its two indices. vec is fixed where
// the parameter enters (a linear weight: its input row; W_K: the query row); every node the value
// then passes maps U_t (a LayerNorm: J_t U_t; a linear map: W^T U_t; relu: its mask on the rows).
//
// U_t is kept as G_t R_t: G_t is what the nodes map, R_t (inner, n_mat) a fixed right factor where
// the parameter enters, or none (R_t = I). Attention's parameters move one head's rows of its
// output, so for all of them G_t starts as that head's rows of the identity and only R_t differs
// (W_Q: s V_i^T Jsm_t K_i; W_K: V_i^T Jsm_t X): the nodes after it map one (width, d_v) G_t per head,
// shared by the head's parameters (pushes of equal G_t are formed once), instead of a
// (width, n_mat) U_t per parameter. G_t is kept in the cheapest exact form: the identity (where
// the parameter enters a linear map), a diagonal (after a pointwise mask), or dense.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "blockhess/backend.hpp"
#include "blockhess/backend_buffer.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/eigen.hpp"
#include "blockhess/engine/rows.hpp"
#include "blockhess/kron_sum.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"

namespace blockhess::engine {

enum class Form { identity, diagonal, dense };

// A dense G_t is stored column by column: the rows of G_t^T follow each other over all tokens, so
// that a linear map of every token (G'_t = W^T G_t, i.e. G'_t^T = G_t^T W) is one (tokens cols, w_in)
// x (w_in, w_out) product instead of a product per token.
template <class T>
using ColMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
template <class T>
using ColMap = Eigen::Map<const ColMat<T>>;
template <class T>
using ColMapM = Eigen::Map<ColMat<T>>;

// Thrown by a push where a selected parameter's tangent factors cannot stay per token: the
// parameter moves the input of an attention, which mixes tokens, with a factor that differs from
// token to token (a lower block of a stack, an embedding), or reaches a sum along two paths whose
// factors then differ. The dense Hessian and the diagonal come from exact Hessian-vector products
// instead (loss.hpp, docs/derivation.md §5.4).
struct FactorsDoNotReach : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A factor's array, in the graph's backend's memory, where every push forms it (docs/backends.md).
template <class T>
class FactorArray {
 public:
  explicit FactorArray(BackendBuffer<T>&& on_backend) : on_backend_(std::move(on_backend)) {}
  const T* data() const { return on_backend_.data(); }
  // Entry k, read on the host: host-addressable memory only.
  const T& operator[](index_t k) const { return data()[k]; }

 private:
  BackendBuffer<T> on_backend_;
};

template <class T>
using SharedArray = std::shared_ptr<const FactorArray<T>>;

template <class T>
SharedArray<T> shared_array(BackendBuffer<T>&& on_backend) {
  return std::make_shared<const FactorArray<T>>(std::move(on_backend));
}

// n values `value` in the backend's memory: the vec [1] of a bias, of gamma and beta.
template <class T>
SharedArray<T> filled(const Backend<T>& backend, index_t n, T value) {
  BackendBuffer<T> b(backend, n);
  backend.run(rows::Fill<T>{b.data(), value}, n);
  return shared_array(std::move(b));
}

template <class T>
struct Factor {
  bool present = false;
  kron::Split split;                     // which index of the parameter vec sits on
  SharedArray<T> vec;                    // (tokens, split.n_vec())
  Form form = Form::dense;
  index_t width = 0;                     // rows of G_t: the width of the value
  SharedArray<T> U;                      // G_t. dense: (tokens, cols(), width), i.e. G_t^T; diagonal: (tokens, cols())
  SharedArray<T> right;                  // R_t: (tokens, inner, n_mat), or null for R_t = I
  index_t inner = 0;

  index_t n_mat() const { return split.n_mat(); }
  index_t cols() const { return right ? inner : n_mat(); }  // columns of G_t
  const T* dense_t(index_t t) const { return U->data() + t * width * cols(); }
  ColMap<T> dense(index_t t) const { return ColMap<T>(dense_t(t), width, cols()); }
  const T* diagonal_t(index_t t) const { return U->data() + t * cols(); }
  MapC<T> right_t(index_t t) const { return MapC<T>(right->data() + t * inner * n_mat(), inner, n_mat()); }

  // Whether two factors' G_t are the same array (their pushes are then the same too).
  bool moves_like(const Factor& o) const {
    return form == o.form && width == o.width && cols() == o.cols() && U == o.U;
  }

  // G_t as a dense (width, cols()) matrix (written into `out` for the identity and diagonal forms).
  void materialise_moving(index_t t, ColMat<T>& out) const {
    const index_t r = cols();
    if (form == Form::dense) {
      out = dense(t);
      return;
    }
    out.setZero(width, r);
    for (index_t k = 0; k < r; ++k) out(k, k) = form == Form::identity ? T(1) : diagonal_t(t)[k];
  }

  // U_t = G_t R_t as a dense (width, n_mat) matrix.
  void materialise(index_t t, Mat<T>& out) const {
    if (form == Form::dense) {
      if (right) out.noalias() = dense(t) * right_t(t);
      else out = dense(t);
      return;
    }
    ColMat<T> G;
    materialise_moving(t, G);
    if (right) out.noalias() = G * right_t(t);
    else out = G;
  }
};

// A parameter entering at a value of `width` columns: U_t = I, vec as given.
template <class T>
Factor<T> entering(const kron::Split& split, SharedArray<T> vec, index_t width) {
  Factor<T> f;
  f.present = true;
  f.split = split;
  f.vec = std::move(vec);
  f.form = Form::identity;
  f.width = width;
  if (split.n_mat() != width) throw std::logic_error("engine: an entering factor's matrix side must be the value's width");
  return f;
}

// The same parameter moved to a new value: same vec and R_t, a new G_t.
template <class T>
Factor<T> moved(const Factor<T>& from, Form form, index_t width, SharedArray<T> G) {
  Factor<T> f = from;
  f.form = form;
  f.width = width;
  f.U = std::move(G);
  return f;
}
template <class T>
Factor<T> moved(const Factor<T>& from, Form form, index_t width, BackendBuffer<T>&& G) {
  return moved(from, form, width, shared_array(std::move(G)));
}

// How a row operation reads a factor's G_t (rows/factors.hpp).
template <class T>
rows::FactorLayout layout_of(const Factor<T>& f) {
  switch (f.form) {
    case Form::identity: return rows::FactorLayout::identity;
    case Form::diagonal: return rows::FactorLayout::diagonal;
    default: return rows::FactorLayout::by_columns;
  }
}
template <class T>
const T* moving_data(const Factor<T>& f) {
  return f.form == Form::identity ? nullptr : f.U->data();
}

namespace detail {

// For each present factor, the first one before it with the same G_t (or itself): a node maps
// each distinct G_t once.
template <class T>
std::vector<size_t> first_alike(const std::vector<const Factor<T>*>& in) {
  std::vector<size_t> first(in.size());
  for (size_t p = 0; p < in.size(); ++p) {
    first[p] = p;
    if (!in[p]->present) continue;
    for (size_t q = 0; q < p; ++q)
      if (in[q]->present && in[q]->moves_like(*in[p])) {
        first[p] = q;
        break;
      }
  }
  return first;
}

}  // namespace detail

// G'_t = J_t G_t for every factor in `in` (one per piece; absent ones stay absent), with J_t the
// (w, w) Jacobian of a norm on its input, on `backend`: jacobians(t0, n, J) writes those of tokens
// [t0, t0 + n) into J, row-major, in the backend's memory. A dense G_t is one product a token (a
// batch), the others are columns of J_t (rows::JacobianColumns). The Jacobians are formed a chunk
// of tokens at a time, the chunk's at most as many entries as the narrowest factor's G' (a (w, w)
// matrix a token outweighs a factor of fewer than w columns).
template <class T, class Jacobians>
std::vector<Factor<T>> left_multiply_jacobians(const Backend<T>& backend, const std::vector<const Factor<T>*>& in,
                                               index_t tokens, index_t w, Jacobians&& jacobians) {
  std::vector<Factor<T>> out(in.size());
  const std::vector<size_t> first = detail::first_alike(in);
  std::vector<BackendBuffer<T>> G(in.size());
  std::vector<size_t> formed;  // the distinct G_t, mapped below
  index_t narrowest = w;
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present && first[p] == p) {
      formed.push_back(p);
      G[p].resize(backend, tokens * in[p]->cols() * w);
      narrowest = std::min(narrowest, in[p]->cols());
    }
  if (formed.empty()) return out;
  const index_t chunk = std::max<index_t>(1, tokens * narrowest / w);
  BackendBuffer<T> J(backend, std::min(chunk, tokens) * w * w);
  for (index_t t0 = 0; t0 < tokens; t0 += chunk) {
    const index_t n = std::min(chunk, tokens - t0);
    jacobians(t0, n, J.data());
    for (size_t p : formed) {
      const Factor<T>& f = *in[p];
      const index_t r = f.cols();
      T* Gp = G[p].data() + t0 * r * w;
      if (f.form == Form::dense)  // G'_t^T = G_t^T J_t^T, each (r, w) row-major
        backend.gemm_batched(n, MatrixView<T>{Gp, r, w, w, true}, r * w,
                             MatrixView<const T>{f.U->data() + t0 * r * w, r, w, w, true}, r * w,
                             MatrixView<const T>{J.data(), w, w, w, false}, w * w, T(1), false);
      else
        backend.run(rows::JacobianColumns<T>{J.data(), f.form == Form::diagonal ? f.U->data() + t0 * r : nullptr, Gp, w, r},
                    n * r);
    }
  }
  std::vector<SharedArray<T>> shared(in.size());
  for (size_t p : formed) shared[p] = shared_array(std::move(G[p]));
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) out[p] = moved(*in[p], Form::dense, w, shared[first[p]]);
  return out;
}

// G'_t = W^T G_t for every factor in `in`, with one weight W (w_in, w_out) for every token (a
// linear map; row-major, or column-major where it is another parameter transposed), on `backend`:
// for a dense G_t, all tokens' G'_t^T = G_t^T W in one product; for the others rows of W, laid out
// by rows once where W is given by columns (rows::TransposeRows).
template <class T>
std::vector<Factor<T>> left_multiply_weight(const Backend<T>& backend, const std::vector<const Factor<T>*>& in,
                                            index_t tokens, MatrixView<const T> weight) {
  const index_t w_in = weight.rows, w_out = weight.cols;
  BackendBuffer<T> by_rows;
  auto rows_of_weight = [&]() -> const T* {
    if (weight.row_major) return weight.data;
    if (!by_rows.data()) {
      by_rows.resize(backend, w_in * w_out);
      backend.run(rows::TransposeRows<T>{weight.data, by_rows.data(), w_in, w_out, weight.stride}, w_in);
    }
    return by_rows.data();
  };
  std::vector<Factor<T>> out(in.size());
  const std::vector<size_t> first = detail::first_alike(in);
  std::vector<SharedArray<T>> shared(in.size());
  for (size_t p = 0; p < in.size(); ++p) {
    if (!in[p]->present || first[p] != p) continue;
    const Factor<T>& f = *in[p];
    const index_t r = f.cols();
    BackendBuffer<T> G(backend, tokens * r * w_out);  // the G'_t^T, token after token
    if (f.form == Form::dense)
      backend.gemm(MatrixView<T>{G.data(), tokens * r, w_out, w_out, true},
                   MatrixView<const T>{f.U->data(), tokens * r, w_in, w_in, true}, weight, T(1), false);
    else  // G_t = diag(delta_t) (or I): G'_t^T = diag(delta_t) W
      backend.run(rows::WeightRows<T>{moving_data(f), rows_of_weight(), G.data(), r, w_out}, tokens * r);
    shared[p] = shared_array(std::move(G));
  }
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) out[p] = moved(*in[p], Form::dense, w_out, shared[first[p]]);
  return out;
}

// (W^T U_t)^T = U_t^T W for every token, (tokens, n_mat, w_out) row by row, with one weight W
// (w_in, w_out): how a linear map of the value moves, its right factor applied (the layout of a
// dense G_t that has none). G_t through W as left_multiply_weight forms it, then R_t^T times that,
// a product a token.
template <class T>
SharedArray<T> through_weight(const Backend<T>& backend, const Factor<T>& f, index_t tokens, const T* weight,
                              index_t w_in, index_t w_out) {
  const Factor<T> mapped = left_multiply_weight(backend, {&f}, tokens, MatrixView<const T>{weight, w_in, w_out, w_out, true}).front();
  if (!f.right) return mapped.U;
  const index_t inner = f.inner, n = f.n_mat();
  BackendBuffer<T> P(backend, tokens * n * w_out);
  backend.gemm_batched(tokens, MatrixView<T>{P.data(), n, w_out, w_out, true}, n * w_out,
                       MatrixView<const T>{f.right->data(), n, inner, n, false}, inner * n,
                       MatrixView<const T>{mapped.U->data(), inner, w_out, w_out, true}, inner * w_out, T(1), false);
  return shared_array(std::move(P));
}

// G'_t = diag(m_t) G_t for a per-token mask or scale m (tokens, width): a pointwise map, on `backend`.
template <class T>
std::vector<Factor<T>> scale_rows(const Backend<T>& backend, const std::vector<const Factor<T>*>& in, index_t tokens,
                                  const T* m) {
  std::vector<Factor<T>> out(in.size());
  const std::vector<size_t> first = detail::first_alike(in);
  for (size_t p = 0; p < in.size(); ++p) {
    if (!in[p]->present) continue;
    if (first[p] != p) {
      out[p] = moved(*in[p], out[first[p]].form, out[first[p]].width, out[first[p]].U);
      continue;
    }
    const Factor<T>& f = *in[p];
    const index_t r = f.cols(), w = f.width;
    const bool dense = f.form == Form::dense;
    BackendBuffer<T> G(backend, tokens * r * (dense ? w : 1));
    backend.run(rows::ScaleFactorRows<T>{m, moving_data(f), G.data(), w, r, dense}, tokens * r);
    out[p] = moved(f, dense ? Form::dense : Form::diagonal, w, std::move(G));
  }
  return out;
}

// U_t = G_t R_t for every token, (tokens, width, n_mat) row by row, as FactorOuterRows reads it,
// on `backend`: a factor with a right factor (an attention's) whose G_t is dense (one product a
// token) or diagonal (rows::DiagonalTimesRows). Under the identity U_t is R_t itself.
template <class T>
BackendBuffer<T> with_right_applied(const Backend<T>& backend, const Factor<T>& f, index_t tokens) {
  const index_t w = f.width, inner = f.inner, n = f.n_mat();
  BackendBuffer<T> U(backend, tokens * w * n);
  if (f.form == Form::dense)  // G_t is kept as G_t^T (inner, w) row-major
    backend.gemm_batched(tokens, MatrixView<T>{U.data(), w, n, n, true}, w * n,
                         MatrixView<const T>{f.U->data(), w, inner, w, false}, inner * w,
                         MatrixView<const T>{f.right->data(), inner, n, n, true}, inner * n, T(1), false);
  else
    backend.run(rows::DiagonalTimesRows<T>{f.U->data(), f.right->data(), U.data(), n}, tokens * w);
  return U;
}

// U_t = G_t R_t of a factor as a row operation reads it, with its layout: G_t itself without a
// right factor, R_t under an identity G_t, else formed into `formed` (with_right_applied), by rows.
template <class T>
std::pair<const T*, rows::FactorLayout> applied(const Backend<T>& backend, const Factor<T>& f, index_t tokens,
                                                BackendBuffer<T>& formed) {
  if (!f.right) return {moving_data(f), layout_of(f)};
  if (f.form == Form::identity) return {f.right->data(), rows::FactorLayout::by_rows};
  formed = with_right_applied(backend, f, tokens);
  return {formed.data(), rows::FactorLayout::by_rows};
}

namespace detail {

// G_t = U_a,t + U_b,t for two sides of a sum with the same vec whose right factors differ: the new
// factor has none.
template <class T>
Factor<T> add_applied(const Backend<T>& backend, const Factor<T>& fa, const Factor<T>& fb, index_t tokens) {
  const index_t w = fa.width, n = fa.n_mat();
  BackendBuffer<T> Ua, Ub, G(backend, tokens * w * n);
  const auto [a, a_layout] = applied(backend, fa, tokens, Ua);
  const auto [b, b_layout] = applied(backend, fb, tokens, Ub);
  backend.run(rows::AddFactors<T>{a, a_layout, b, b_layout, G.data(), w, n}, tokens * n);
  Factor<T> f = moved(fa, Form::dense, w, std::move(G));
  f.right = nullptr, f.inner = 0;
  return f;
}

}  // namespace detail

// The factors of a sum of two values, piece by piece, on `backend`: a piece reaching both (along
// two paths from where it entered, so with the same vec) moves the sum by G_a + G_b, or by
// U_a + U_b where one path applied its R_t (an attention that mixed it) and the other kept it.
template <class T>
std::vector<Factor<T>> add(const Backend<T>& backend, const std::vector<const Factor<T>*>& a,
                           const std::vector<const Factor<T>*>& b, index_t tokens) {
  std::vector<Factor<T>> out(a.size());
  for (size_t p = 0; p < a.size(); ++p) {
    if (!a[p]->present || !b[p]->present) {
      out[p] = a[p]->present ? *a[p] : *b[p];
      continue;
    }
    const Factor<T>&fa = *a[p], &fb = *b[p];
    if (fa.vec != fb.vec)
      throw FactorsDoNotReach("engine: a parameter reaches a sum along two paths with different factors (one of them "
                              "through an attention, which mixes tokens): the per-token factors do not reach it");
    if (fa.right != fb.right) {  // one side's R_t applied (an attention mixed it), the other's kept: add U_t
      out[p] = detail::add_applied(backend, fa, fb, tokens);
      continue;
    }
    // Pieces whose G_t are alike on both sides share their sum.
    bool shared = false;
    for (size_t q = 0; q < p && !shared; ++q)
      if (a[q]->present && b[q]->present && a[q]->moves_like(fa) && b[q]->moves_like(fb))
        out[p] = moved(fa, Form::dense, fa.width, out[q].U), shared = true;
    if (shared) continue;
    const index_t r = fa.cols(), w = fa.width;
    BackendBuffer<T> G(backend, tokens * w * r);
    backend.run(rows::AddFactors<T>{moving_data(fa), layout_of(fa), moving_data(fb), layout_of(fb), G.data(), w, r},
                tokens * r);
    out[p] = moved(fa, Form::dense, w, std::move(G));
  }
  return out;
}

}  // namespace blockhess::engine
