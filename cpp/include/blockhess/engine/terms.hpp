// The curvature a node contributes to a Hessian, as data (docs/derivation.md §4).
//
// The second differential of a scalar l of the block's output is a sum of two kinds of terms:
// - sites: a token-local second derivative at a value v, sum_t dv_t^T Omega_t dv_t (a LayerNorm row
//   contracted with its output's cotangent; the loss itself at the output, which is the outer,
//   Gauss-Newton part). Every pair of parameters that reaches v meets there, with
//   Gamma_t = U_i,t^T Omega_t U_j,t from their factors at v (factor.hpp);
// - bilinear terms: two varying operands multiplied, <g, dA dB> (a linear map's input and weight,
//   attention's A and V, Q and K). These name their two parameters and bring their own vectors and
//   Gamma_t (KronTerm), or a diagonal Gamma_t (DiagonalTerm).
// - pooled sites: a second derivative that couples every pair of tokens of a sample through their
//   mean, sum_b (sum_t dv_b,t)^T Omega_b (sum_s dv_b,s) (a pooled classifier head's loss: the outer
//   part of loss="pooled_cross_entropy"). Each sample's Jacobian at v, summed over its tokens, meets
//   Omega_b.
// The assembler (assemble.hpp) turns each into kron::accumulate calls on the selected pairs (pooled
// sites into products of the token-summed Jacobians).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/kron_sum.hpp"

namespace blockhess::engine {

template <class T>
struct Site {
  int value = -1;
  std::shared_ptr<const Buffer<T>> omega;  // (tokens, width, width), each Omega_t symmetric
  bool diagonal = false;                   // omega holds only the diagonals: (tokens, width)
};

template <class T>
struct PooledSite {
  int value = -1;
  std::shared_ptr<const Buffer<T>> omega;  // (samples, width, width), each Omega_b symmetric
};

// H[i, j] += sum_t u_t (x) w_t (x) Gamma_t, in kron::accumulate's convention.
template <class T>
struct KronTerm {
  int i = -1, j = -1;
  kron::Split si, sj;
  const T* u = nullptr;  // (tokens, si.n_vec())
  const T* w = nullptr;  // (tokens, sj.n_vec())
  std::function<void(index_t, T*)> gamma;  // writes Gamma_t, (si.n_mat(), sj.n_mat()) row-major
  bool symmetric = false;  // i == j with the same factors on both sides: the upper triangle suffices
  // For a symmetric term, optionally: writes only the diagonal of Gamma_t (si.n_mat() values), all
  // that the Hessian's diagonal reads of it (diagonal.hpp), at a fraction of the full Gamma_t's cost.
  std::function<void(index_t, T*)> gamma_diagonal;
};

// As KronTerm with Gamma_t = diag(D_t) (kron::accumulate_diagonal).
template <class T>
struct DiagonalTerm {
  int i = -1, j = -1;
  kron::Split si, sj;
  const T* u = nullptr;
  const T* w = nullptr;
  const T* D = nullptr;  // (tokens, r), or null for the identity
};

template <class T>
struct Terms {
  std::vector<Site<T>> sites;
  std::vector<PooledSite<T>> pooled;
  std::vector<KronTerm<T>> kron;
  std::vector<DiagonalTerm<T>> diagonal;
  std::vector<std::shared_ptr<const Buffer<T>>> keep;  // buffers the terms point into

  const T* kept(Buffer<T>&& buffer) {
    keep.push_back(std::make_shared<const Buffer<T>>(std::move(buffer)));
    return keep.back()->data();
  }
};

}  // namespace blockhess::engine
