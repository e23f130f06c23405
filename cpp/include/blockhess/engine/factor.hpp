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
#include <memory>
#include <stdexcept>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/eigen.hpp"
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

template <class T>
struct Factor {
  bool present = false;
  kron::Split split;                     // which index of the parameter vec sits on
  std::shared_ptr<const Buffer<T>> vec;  // (tokens, split.n_vec())
  Form form = Form::dense;
  index_t width = 0;                     // rows of G_t: the width of the value
  std::shared_ptr<const Buffer<T>> U;    // G_t. dense: (tokens, cols(), width), i.e. G_t^T; diagonal: (tokens, cols())
  std::shared_ptr<const Buffer<T>> right;  // R_t: (tokens, inner, n_mat), or null for R_t = I
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
Factor<T> entering(const kron::Split& split, std::shared_ptr<const Buffer<T>> vec, index_t width) {
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
Factor<T> moved(const Factor<T>& from, Form form, index_t width, std::shared_ptr<const Buffer<T>> G) {
  Factor<T> f = from;
  f.form = form;
  f.width = width;
  f.U = std::move(G);
  return f;
}
template <class T>
Factor<T> moved(const Factor<T>& from, Form form, index_t width, Buffer<T>&& G) {
  return moved(from, form, width, std::make_shared<const Buffer<T>>(std::move(G)));
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

// G'_t = M_t G_t for every factor in `in` (one per piece; absent ones stay absent), with M_t
// the (w_out, w_in) Jacobian of a node on its input: matrix_of(t) returns it (or one shared
// matrix), formed once per token for all the pieces.
template <class T, class MatrixOf>
std::vector<Factor<T>> left_multiply(const std::vector<const Factor<T>*>& in, index_t tokens, index_t w_out,
                                     MatrixOf&& matrix_of) {
  std::vector<Factor<T>> out(in.size());
  const std::vector<size_t> first = detail::first_alike(in);
  std::vector<Buffer<T>> G(in.size());
  std::vector<size_t> formed;  // the distinct G_t, mapped below
  index_t work = 0;
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present && first[p] == p) {
      formed.push_back(p);
      G[p].resize(static_cast<size_t>(tokens * w_out * in[p]->cols()));
      work += w_out * in[p]->width * in[p]->cols();
    }
  if (work == 0) return out;
  blockhess::detail::parallel_for(tokens, work, [&](index_t t) {
    const auto& M = matrix_of(t);  // (w_out, w_in)
    for (size_t p : formed) {
      const Factor<T>& f = *in[p];
      const index_t r = f.cols();
      ColMapM<T> o(G[p].data() + t * w_out * r, w_out, r);
      if (f.form == Form::dense) {
        o.noalias() = M * f.dense(t);
      } else if (f.form == Form::identity) {
        o = M;
      } else {
        const T* dg = f.diagonal_t(t);
        for (index_t k = 0; k < r; ++k) o.col(k) = M.col(k) * dg[k];
      }
    }
  });
  std::vector<std::shared_ptr<const Buffer<T>>> shared(in.size());
  for (size_t p : formed) shared[p] = std::make_shared<const Buffer<T>>(std::move(G[p]));
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) out[p] = moved(*in[p], Form::dense, w_out, shared[first[p]]);
  return out;
}

// G'_t = W^T G_t for every factor in `in`, with one weight W (w_in, w_out) for every token (a
// linear map): for a dense G_t, all tokens' G'_t^T = G_t^T W at once.
template <class T>
std::vector<Factor<T>> left_multiply_weight(const Backend<T>& backend, const std::vector<const Factor<T>*>& in,
                                            index_t tokens, const T* weight, index_t w_in, index_t w_out) {
  std::vector<Factor<T>> out(in.size());
  const std::vector<size_t> first = detail::first_alike(in);
  const MapC<T> W(weight, w_in, w_out);
  std::vector<std::shared_ptr<const Buffer<T>>> shared(in.size());
  for (size_t p = 0; p < in.size(); ++p) {
    if (!in[p]->present || first[p] != p) continue;
    const Factor<T>& f = *in[p];
    const index_t r = f.cols();
    Buffer<T> G(static_cast<size_t>(tokens * r * w_out));
    MapM<T> Gt(G.data(), tokens * r, w_out);  // the G'_t^T, token after token
    if (f.form == Form::dense) {
      product(backend, Gt, MapC<T>(f.U->data(), tokens * r, w_in), W, T(1), false);
    } else {  // G_t = diag(delta_t) (or I): G'_t^T = diag(delta_t) W
      blockhess::detail::parallel_for(tokens, r * w_out, [&](index_t t) {
        for (index_t k = 0; k < r; ++k)
          Gt.row(t * r + k) = (f.form == Form::identity ? T(1) : f.diagonal_t(t)[k]) * W.row(k);
      });
    }
    shared[p] = std::make_shared<const Buffer<T>>(std::move(G));
  }
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) out[p] = moved(*in[p], Form::dense, w_out, shared[first[p]]);
  return out;
}

// G'_t = diag(m_t) G_t for a per-token mask or scale m (tokens, width): a pointwise map.
template <class T>
std::vector<Factor<T>> scale_rows(const std::vector<const Factor<T>*>& in, index_t tokens, const T* m) {
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
    if (f.form == Form::dense) {
      Buffer<T> G(static_cast<size_t>(tokens * w * r));
      blockhess::detail::parallel_for(tokens, w * r, [&](index_t t) {
        const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> mt(m + t * w, w);
        ColMapM<T>(G.data() + t * w * r, w, r).noalias() = mt.asDiagonal() * f.dense(t);
      });
      out[p] = moved(f, Form::dense, w, std::move(G));
      continue;
    }
    Buffer<T> D(static_cast<size_t>(tokens * r));
    for (index_t t = 0; t < tokens; ++t)
      for (index_t k = 0; k < r; ++k) D[t * r + k] = m[t * w + k] * (f.form == Form::identity ? T(1) : f.diagonal_t(t)[k]);
    out[p] = moved(f, Form::diagonal, w, std::move(D));
  }
  return out;
}

// The factors of a sum of two values, piece by piece: a piece reaching both (along two paths
// from where it entered, so with the same vec and R_t) moves the sum by G_a + G_b.
template <class T>
std::vector<Factor<T>> add(const std::vector<const Factor<T>*>& a, const std::vector<const Factor<T>*>& b, index_t tokens) {
  std::vector<Factor<T>> out(a.size());
  for (size_t p = 0; p < a.size(); ++p) {
    if (!a[p]->present || !b[p]->present) {
      out[p] = a[p]->present ? *a[p] : *b[p];
      continue;
    }
    const Factor<T>&fa = *a[p], &fb = *b[p];
    if (fa.right != fb.right || fa.vec != fb.vec)
      throw FactorsDoNotReach("engine: a parameter reaches a sum along two paths with different factors (one of them "
                              "through an attention, which mixes tokens): the per-token factors do not reach it");
    // Pieces whose G_t are alike on both sides share their sum.
    bool shared = false;
    for (size_t q = 0; q < p && !shared; ++q)
      if (a[q]->present && b[q]->present && a[q]->moves_like(fa) && b[q]->moves_like(fb))
        out[p] = moved(fa, Form::dense, fa.width, out[q].U), shared = true;
    if (shared) continue;
    const index_t r = fa.cols(), w = fa.width;
    Buffer<T> G(static_cast<size_t>(tokens * w * r));
    blockhess::detail::parallel_for(tokens, w * r, [&](index_t t) {
      ColMapM<T> sum(G.data() + t * w * r, w, r);
      ColMat<T> scratch;
      if (fa.form == Form::dense) sum = fa.dense(t);
      else fa.materialise_moving(t, scratch), sum = scratch;
      if (fb.form == Form::dense) sum += fb.dense(t);
      else fb.materialise_moving(t, scratch), sum += scratch;
    });
    out[p] = moved(fa, Form::dense, w, std::move(G));
  }
  return out;
}

}  // namespace blockhess::engine
