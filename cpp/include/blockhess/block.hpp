// The post-LN Transformer block of docs/derivation.md §2.1, for a batch of B samples:
//   T = X W_Q W_K^T X^T / sqrt(d_k),  A = softmax_rows(T),  F = A X W_V,
//   Y = LN(X + F),  R = relu(Y W_1),  S = R W_2 + Y,  Z = LN(S)
// (no biases, LayerNorm without affine parameters, optional eps). This header holds the forward
// pass with its caches and the reverse pass that carries a cotangent of Z back to every
// intermediate: everything the Jacobians and Hessians are assembled from.
#pragma once

#include <Eigen/Core>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/eigen.hpp"
#include "blockhess/finite.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/parallel.hpp"
#include "blockhess/parallel_product.hpp"
#include "blockhess/params.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::block {

template <class T>
struct Weights {
  std::array<const T*, kNumParams> w{};  // row-major, shapes Dims::rows(p) x Dims::cols(p)
};


// Forward caches for B samples; every token-major array has B*L rows.
template <class T>
struct Forward {
  Dims dims;
  index_t B = 0;
  const T* X = nullptr;                 // (B*L, d): points into X_copy
  Buffer<T> X_copy;                     // aligned copies of the inputs (see buffer.hpp)
  std::array<Buffer<T>, kNumParams> W_copy;
  Buffer<T> Q, K, V;               // (B*L, dk), (B*L, dk), (B*L, d)
  Buffer<T> A;                     // (B, L, L) attention weights
  Buffer<T> F;                     // (B*L, d) attention output
  Buffer<T> Y, sigma1;             // first LayerNorm output and row std
  Buffer<T> H1, R;                 // pre-activation Y W_1 and relu(H1), (B*L, dff)
  Buffer<T> Z, sigma2;             // block output and second LayerNorm row std

  index_t tokens() const { return B * dims.L; }
  const T* weight(int p) const { return W_copy[p].data(); }
  T inv_sqrt_dk() const { return T(1) / std::sqrt(static_cast<T>(dims.dk)); }
};

// Cotangents of a scalar (a loss, or one output entry) with respect to every intermediate.
template <class T>
struct Reverse {
  Buffer<T> gS;   // (B*L, d)   d/dS
  Buffer<T> gH1;  // (B*L, dff) d/d(Y W_1)
  Buffer<T> gY;   // (B*L, d)   d/dY, through both the FFN and its residual
  Buffer<T> gF;   // (B*L, d)   d/dF = d/d(X + F)
  Buffer<T> gA;   // (B, L, L)  d/dA
  Buffer<T> gT;   // (B, L, L)  d/dT
};

template <class T>
Forward<T> forward(const Dims& dims, index_t B, const T* X, const Weights<T>& W, T eps) {
  dims.check();
  const index_t L = dims.L, d = dims.d, dk = dims.dk, dff = dims.dff, n = B * L;
  Forward<T> f;
  f.dims = dims;
  f.B = B;
  f.X_copy.assign(X, X + n * d);
  f.X = f.X_copy.data();
  for (int p = 0; p < kNumParams; ++p) f.W_copy[p].assign(W.w[p], W.w[p] + dims.size(p));
  f.Q.resize(n * dk), f.K.resize(n * dk), f.V.resize(n * d), f.A.resize(B * L * L), f.F.resize(n * d);
  f.Y.resize(n * d), f.sigma1.resize(n), f.H1.resize(n * dff), f.R.resize(n * dff);
  f.Z.resize(n * d), f.sigma2.resize(n);

  // Every stage is checked as it is formed, so that finite inputs which drive one past the float
  // range (weights near 1e160 make X W_Q W_K^T X^T infinite, and softmax then NaN) end in an error
  // naming that stage, before a later one (a LayerNorm) misreads the non-finite values.
  const MapC<T> Xm(f.X, n, d);
  product(MapM<T>(f.Q.data(), n, dk), Xm, MapC<T>(f.weight(W_Q), d, dk), T(1), false);
  product(MapM<T>(f.K.data(), n, dk), Xm, MapC<T>(f.weight(W_K), d, dk), T(1), false);
  product(MapM<T>(f.V.data(), n, d), Xm, MapC<T>(f.weight(W_V), d, d), T(1), false);
  require_finite(f.Q.data(), n * dk, "block: the queries X W_Q");
  require_finite(f.K.data(), n * dk, "block: the keys X W_K");
  require_finite(f.V.data(), n * d, "block: the values X W_V");
  const T scale = f.inv_sqrt_dk();
  for (index_t b = 0; b < B; ++b) {
    MapM<T> A(f.A.data() + b * L * L, L, L);
    product(A, MapC<T>(f.Q.data() + b * L * dk, L, dk), MapC<T>(f.K.data() + b * L * dk, L, dk).transpose(), scale, false);
    for (index_t i = 0; i < L; ++i) softmax::forward_row(A.data() + i * L, L, A.data() + i * L);
    product(MapM<T>(f.F.data() + b * L * d, L, d), A, MapC<T>(f.V.data() + b * L * d, L, d), T(1), false);
  }
  require_finite(f.A.data(), B * L * L, "block: the attention weights softmax(X W_Q W_K^T X^T / sqrt(d_k))");
  require_finite(f.F.data(), n * d, "block: the attention output A X W_V");
  Buffer<T> S(n * d);
  MapM<T>(S.data(), n, d) = Xm + MapC<T>(f.F.data(), n, d);
  require_finite(S.data(), n * d, "block: the residual X + F");
  layernorm::normalize(S.data(), n, d, eps, f.Y.data(), f.sigma1.data());
  product(MapM<T>(f.H1.data(), n, dff), MapC<T>(f.Y.data(), n, d), MapC<T>(f.weight(W_1), d, dff), T(1), false);
  require_finite(f.H1.data(), n * dff, "block: the FFN pre-activations Y W_1");
  MapM<T>(f.R.data(), n, dff) = MapC<T>(f.H1.data(), n, dff).cwiseMax(T(0));
  product(MapM<T>(S.data(), n, d), MapC<T>(f.R.data(), n, dff), MapC<T>(f.weight(W_2), dff, d), T(1), false);
  MapM<T>(S.data(), n, d) += MapC<T>(f.Y.data(), n, d);
  require_finite(S.data(), n * d, "block: the FFN output with its residual relu(Y W_1) W_2 + Y");
  layernorm::normalize(S.data(), n, d, eps, f.Z.data(), f.sigma2.data());
  return f;
}

// Carry gZ (B*L, d) back through the block.
template <class T>
Reverse<T> reverse(const Forward<T>& f, const T* gZ) {
  const Dims& D = f.dims;
  const index_t L = D.L, d = D.d, dff = D.dff, n = f.tokens();
  Reverse<T> r;
  r.gS.resize(n * d), r.gH1.resize(n * dff), r.gY.resize(n * d), r.gF.resize(n * d), r.gA.resize(f.B * L * L), r.gT.resize(f.B * L * L);
  for (index_t t = 0; t < n; ++t) layernorm::vjp_row(f.Z.data() + t * d, f.sigma2[t], gZ + t * d, d, r.gS.data() + t * d);
  MapM<T> gH1(r.gH1.data(), n, dff);
  product(gH1, MapC<T>(r.gS.data(), n, d), MapC<T>(f.weight(W_2), dff, d).transpose(), T(1), false);
  for (index_t k = 0; k < n * dff; ++k)
    if (!(f.H1[k] > T(0))) r.gH1[k] = T(0);  // relu'(0) is taken as 0
  product(MapM<T>(r.gY.data(), n, d), gH1, MapC<T>(f.weight(W_1), d, dff).transpose(), T(1), false);
  MapM<T>(r.gY.data(), n, d) += MapC<T>(r.gS.data(), n, d);
  for (index_t t = 0; t < n; ++t) layernorm::vjp_row(f.Y.data() + t * d, f.sigma1[t], r.gY.data() + t * d, d, r.gF.data() + t * d);
  for (index_t b = 0; b < f.B; ++b) {
    product(MapM<T>(r.gA.data() + b * L * L, L, L), MapC<T>(r.gF.data() + b * L * d, L, d),
            MapC<T>(f.V.data() + b * L * d, L, d).transpose(), T(1), false);
  }
  for (index_t t = 0; t < n; ++t) softmax::vjp_row(f.A.data() + t * L, r.gA.data() + t * L, L, r.gT.data() + t * L);
  require_finite(r.gS.data(), n * d, "block: the reverse pass through the second LayerNorm");
  require_finite(r.gF.data(), n * d, "block: the reverse pass through the FFN and the first LayerNorm");
  require_finite(r.gT.data(), f.B * L * L, "block: the reverse pass through the attention weights");
  return r;
}

// Gradient of the scalar behind `r` with respect to the weights, concatenated in Param order.
template <class T>
void weight_gradient(const Forward<T>& f, const Reverse<T>& r, T* out) {
  const Dims& D = f.dims;
  const index_t L = D.L, d = D.d, dk = D.dk, dff = D.dff, n = f.tokens();
  const T s = f.inv_sqrt_dk();
  MapM<T> gQ(out, d, dk), gK(out + d * dk, d, dk), gV(out + 2 * d * dk, d, d);
  gQ.setZero(), gK.setZero(), gV.setZero();
  for (index_t b = 0; b < f.B; ++b) {
    const MapC<T> X(f.X + b * L * d, L, d), gT(r.gT.data() + b * L * L, L, L), A(f.A.data() + b * L * L, L, L);
    const MapC<T> Q(f.Q.data() + b * L * dk, L, dk), K(f.K.data() + b * L * dk, L, dk);
    const MapC<T> gF(r.gF.data() + b * L * d, L, d);
    gQ.noalias() += s * X.transpose() * (gT * K);
    gK.noalias() += s * X.transpose() * (gT.transpose() * Q);
    gV.noalias() += X.transpose() * (A.transpose() * gF);
  }
  T* o = out + 2 * d * dk + d * d;
  product(MapM<T>(o, d, dff), MapC<T>(f.Y.data(), n, d).transpose(), MapC<T>(r.gH1.data(), n, dff), T(1), false);
  product(MapM<T>(o + d * dff, dff, d), MapC<T>(f.R.data(), n, dff).transpose(), MapC<T>(r.gS.data(), n, d), T(1),
          false);
}

}  // namespace blockhess::block
