// Per-token tangent factors: how a value of the block moves with one parameter.
//
// Inside a block every parameter's first derivative factorises per token t (docs/derivation.md
// §4.2): the tangent of a value's row t is U_t (vec_t (x) dW), a small matrix U_t applied to the
// parameter's tangent contracted with a vector vec_t on one of its two indices. vec is fixed where
// the parameter enters (a linear weight: its input row; W_K: the query row); every node the value
// then passes maps U_t (a LayerNorm: J_t U_t; a linear map: W^T U_t; relu: its mask on the rows).
// U_t is kept in the cheapest exact form: the identity (where the parameter enters a linear map),
// a diagonal (after a pointwise mask), or dense.
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

namespace blockhess::engine {

enum class Form { identity, diagonal, dense };

template <class T>
struct Factor {
  bool present = false;
  kron::Split split;                     // which index of the parameter vec sits on
  std::shared_ptr<const Buffer<T>> vec;  // (tokens, split.n_vec())
  Form form = Form::dense;
  index_t width = 0;                     // rows of U_t: the width of the value
  std::shared_ptr<const Buffer<T>> U;    // dense: (tokens, width, n_mat); diagonal: (tokens, n_mat)

  index_t n_mat() const { return split.n_mat(); }
  const T* dense_t(index_t t) const { return U->data() + t * width * n_mat(); }
  const T* diagonal_t(index_t t) const { return U->data() + t * n_mat(); }

  // U_t as a dense (width, n_mat) matrix (written into `out` for the identity and diagonal forms).
  void materialise(index_t t, Mat<T>& out) const {
    const index_t r = n_mat();
    if (form == Form::dense) {
      out = MapC<T>(dense_t(t), width, r);
      return;
    }
    out.setZero(width, r);
    for (index_t k = 0; k < r; ++k) out(k, k) = form == Form::identity ? T(1) : diagonal_t(t)[k];
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

// The same parameter moved to a new value: same vec, new U (dense unless the caller says so).
template <class T>
Factor<T> moved(const Factor<T>& from, Form form, index_t width, Buffer<T>&& U) {
  Factor<T> f;
  f.present = true;
  f.split = from.split;
  f.vec = from.vec;
  f.form = form;
  f.width = width;
  f.U = std::make_shared<const Buffer<T>>(std::move(U));
  return f;
}

// U'_t = M_t U_t for every factor in `in` (one per parameter; absent ones stay absent), with M_t
// the (w_out, w_in) Jacobian of a node on its input: matrix_of(t) returns it (or one shared
// matrix), formed once per token for all the parameters.
template <class T, class MatrixOf>
std::vector<Factor<T>> left_multiply(const std::vector<const Factor<T>*>& in, index_t tokens, index_t w_out,
                                     MatrixOf&& matrix_of) {
  std::vector<Factor<T>> out(in.size());
  std::vector<Buffer<T>> U(in.size());
  index_t work = 0;
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) {
      U[p].resize(static_cast<size_t>(tokens * w_out * in[p]->n_mat()));
      work += w_out * in[p]->width * in[p]->n_mat();
    }
  if (work == 0) return out;
  blockhess::detail::parallel_for(tokens, work, [&](index_t t) {
    const auto& M = matrix_of(t);  // (w_out, w_in)
    for (size_t p = 0; p < in.size(); ++p) {
      const Factor<T>& f = *in[p];
      if (!f.present) continue;
      const index_t r = f.n_mat();
      MapM<T> o(U[p].data() + t * w_out * r, w_out, r);
      if (f.form == Form::dense) {
        o.noalias() = M * MapC<T>(f.dense_t(t), f.width, r);
      } else if (f.form == Form::identity) {
        o = M;
      } else {
        const T* dg = f.diagonal_t(t);
        for (index_t k = 0; k < r; ++k) o.col(k) = M.col(k) * dg[k];
      }
    }
  });
  for (size_t p = 0; p < in.size(); ++p)
    if (in[p]->present) out[p] = moved(*in[p], Form::dense, w_out, std::move(U[p]));
  return out;
}

// U'_t = diag(m_t) U_t for a per-token mask or scale m (tokens, width): a pointwise map.
template <class T>
Factor<T> scale_rows(const Factor<T>& in, index_t tokens, const T* m) {
  const index_t r = in.n_mat(), w = in.width;
  if (in.form == Form::dense) {
    Buffer<T> U(static_cast<size_t>(tokens * w * r));
    blockhess::detail::parallel_for(tokens, w * r, [&](index_t t) {
      const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> mt(m + t * w, w);
      MapM<T>(U.data() + t * w * r, w, r).noalias() = mt.asDiagonal() * MapC<T>(in.dense_t(t), w, r);
    });
    return moved(in, Form::dense, w, std::move(U));
  }
  Buffer<T> D(static_cast<size_t>(tokens * r));
  for (index_t t = 0; t < tokens; ++t)
    for (index_t k = 0; k < r; ++k) D[t * r + k] = m[t * w + k] * (in.form == Form::identity ? T(1) : in.diagonal_t(t)[k]);
  return moved(in, Form::diagonal, w, std::move(D));
}

// The factor of a sum of values that the parameter reaches along several paths.
template <class T>
Factor<T> add(const Factor<T>& a, const Factor<T>& b, index_t tokens) {
  if (!a.present) return b;
  if (!b.present) return a;
  const index_t r = a.n_mat(), w = a.width;
  Buffer<T> U(static_cast<size_t>(tokens * w * r));
  blockhess::detail::parallel_for(tokens, w * r, [&](index_t t) {
    MapM<T> out(U.data() + t * w * r, w, r);
    Mat<T> scratch;
    if (a.form == Form::dense) out = MapC<T>(a.dense_t(t), w, r);
    else a.materialise(t, scratch), out = scratch;
    if (b.form == Form::dense) out += MapC<T>(b.dense_t(t), w, r);
    else b.materialise(t, scratch), out += scratch;
  });
  return moved(a, Form::dense, w, std::move(U));
}

}  // namespace blockhess::engine
