// The pointwise node's per-token work (engine/nodes/pointwise.hpp) as row operations
// (engine/row_ops.hpp): entry by entry, so an item is one entry of the (tokens, width) arrays.
#pragma once

#include "blockhess/activation.hpp"
#include "blockhess/config.hpp"

namespace blockhess::engine::rows {

// y = phi(x), with phi'(x) into first and, unless second is null (relu: phi'' = 0), phi''(x).
template <class T>
struct ActivationForward {
  activation::Kind kind;
  const T* x;
  T* y;
  T* first;
  T* second;
  index_t cost() const { return activation::is_piecewise_linear(kind) ? 1 : 32; }  // a tanh, exp or erf: about 32
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    if (!second) {  // relu with the kind a constant: the compiler folds the switch and vectorises the loop
      for (index_t k = begin; k < end; ++k) {
        T unused;
        activation::evaluate(activation::Kind::relu, x[k], &y[k], &first[k], &unused);
      }
      return;
    }
    for (index_t k = begin; k < end; ++k) activation::evaluate(kind, x[k], &y[k], &first[k], &second[k]);
  }
};

// The tangent of the cotangent phi' g: phi' dg, plus (second not null) phi'' g dx; assigned or added.
template <class T>
struct ActivationCotangentTangent {
  const T* first;
  const T* second;  // null: the linear part only
  const T* dg;
  const T* g;
  const T* dx;
  T* out;
  bool add;
  index_t cost() const { return 2; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      T v = first[k] * dg[k];
      if (second) v += second[k] * g[k] * dx[k];
      out[k] = add ? out[k] + v : v;
    }
  }
};

}  // namespace blockhess::engine::rows
