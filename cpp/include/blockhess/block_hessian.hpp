// Exact Jacobians and Hessians of the Transformer block with respect to its five weight matrices.
//
// Second differential of a scalar l(Z(W)) (a loss, or one output entry):
//   d2l = dZ^T H_l dZ                                   outer (Gauss-Newton) part
//       + <gZ, LN2''[dS,dS]> + <gY, LN1''[dF,dF]>       LayerNorm curvature
//       + 2<gS, dR dW_2> + 2<gH1, dY dW_1>              FFN bilinear terms (relu'' = 0 a.e.)
//       + 2<gF, dA dV> + <gA, softmax''[dT,dT]> + 2<gT, dQ dK^T>/sqrt(d_k)   attention
// (g* are the cotangents of block.hpp's reverse pass.) This is docs/derivation.md §4.1 with the corrected
// xi / Phi blocks of its §4.3 (errata E3-E8), written as a sum over the block's nodes.
//
// Every first derivative factorises per token t into a vector on one index of the parameter and a
// small matrix on the other (see kron_sum.hpp). With Jc_t = J_SY,t J_Y,t (d x d):
//   W_Q: dF_t = Mq_t dW_Q^T x_t,   Mq_t = V^T Jsm_t K / sqrt(d_k)     vector x_t on rows,  matrix (d, d_k)
//   W_K: dF_t = Mk_t dW_K q_t/√dk, Mk_t = V^T Jsm_t X                 vector q_t on cols,  matrix (d, d)
//   W_V: dF_t = dW_V^T (A X)_t                                        vector (AX)_t on rows, matrix I_d
//   W_1: dS_t = W_2^T diag(mask_t) dW_1^T y_t                         vector y_t on rows,  matrix (d, d_ff)
//   W_2: dS_t = dW_2^T r_t                                            vector r_t on rows,  matrix I_d
// with Jsm_t = diag(a_t) - a_t a_t^T, and dS_t = Jc_t dF_t for the attention weights. Each term of
// d2l is then a sum over tokens of (vector x vector) (x) (small Gamma_t), assembled by GEMMs.
#pragma once

#include <Eigen/Core>
#include <array>
#include <vector>

#include "blockhess/block.hpp"
#include "blockhess/kron_sum.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/loss.hpp"
#include "blockhess/softmax.hpp"

namespace blockhess::block {

enum class Part : int { full = 0, outer = 1, functional = 2 };

// Per-token factorisations of the five parameter Jacobians (see the header comment).
template <class T>
struct Factors {
  std::array<kron::Split, kNumParams> split;
  std::array<Buffer<T>, kNumParams> vec;  // (tokens, n_vec)
  std::array<Buffer<T>, kNumParams> US;   // (tokens, d, n_mat): derivative of S
  std::array<Buffer<T>, 3> UF, UY;        // attention only: derivatives of F and of Y
};

// J_Y,t (the first LayerNorm's Jacobian) for token t.
template <class T>
Mat<T> first_ln_jacobian(const Forward<T>& f, index_t t) {
  const index_t d = f.dims.d;
  Mat<T> J(d, d);
  layernorm::jacobian_row(f.Y.data() + t * d, f.sigma1[t], static_cast<const T*>(nullptr), d, J.data());
  return J;
}

template <class T>
Factors<T> factorize(const Forward<T>& f) {
  const Dims& D = f.dims;
  const index_t L = D.L, d = D.d, dk = D.dk, dff = D.dff, n = f.tokens();
  const T s = f.inv_sqrt_dk();
  Factors<T> fa;
  fa.split = {kron::Split{d, dk, true}, kron::Split{d, dk, false}, kron::Split{d, d, true},
              kron::Split{d, dff, true}, kron::Split{dff, d, true}};
  for (int p = 0; p < kNumParams; ++p) {
    fa.vec[p].resize(n * fa.split[p].n_vec());
    fa.US[p].resize(n * d * fa.split[p].n_mat());
    if (p < 3) fa.UF[p].resize(n * d * fa.split[p].n_mat()), fa.UY[p].resize(n * d * fa.split[p].n_mat());
  }
  const MapC<T> W1(f.weight(W_1), d, dff), W2(f.weight(W_2), dff, d);
  blockhess::detail::parallel_for(n, L * d * (d + dk) + d * d * dff, [&](index_t t) {
    const index_t b = t / L;
    const MapC<T> X(f.X + b * L * d, L, d), K(f.K.data() + b * L * dk, L, dk), V(f.V.data() + b * L * d, L, d);
    const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> a(f.A.data() + t * L, L);
    const auto x = MapC<T>(f.X + t * d, 1, d), q = MapC<T>(f.Q.data() + t * dk, 1, dk);
    const auto F = MapC<T>(f.F.data() + t * d, 1, d);

    // Vectors.
    MapM<T>(fa.vec[W_Q].data() + t * d, 1, d) = x;
    MapM<T>(fa.vec[W_K].data() + t * dk, 1, dk) = s * q;
    MapM<T>(fa.vec[W_V].data() + t * d, 1, d).noalias() = a.transpose() * X;  // (A X)_t
    MapM<T>(fa.vec[W_1].data() + t * d, 1, d) = MapC<T>(f.Y.data() + t * d, 1, d);
    MapM<T>(fa.vec[W_2].data() + t * dff, 1, dff) = MapC<T>(f.R.data() + t * dff, 1, dff);

    // Derivatives of F: Mq = V^T Jsm K / sqrt(dk), Mk = V^T Jsm X, I for W_V.
    const Mat<T> Va = a.asDiagonal() * V;  // rows a_s V_s
    const Mat<T> Kbar = a.transpose() * K, Xbar = a.transpose() * X;
    MapM<T> Mq(fa.UF[W_Q].data() + t * d * dk, d, dk), Mk(fa.UF[W_K].data() + t * d * d, d, d);
    Mq.noalias() = s * (Va.transpose() * K - F.transpose() * Kbar);
    Mk.noalias() = Va.transpose() * X - F.transpose() * Xbar;
    MapM<T>(fa.UF[W_V].data() + t * d * d, d, d).setIdentity();

    // Through the first LayerNorm (J_Y) and the FFN with its residual (J_SY).
    const Mat<T> JY = first_ln_jacobian(f, t);
    Mat<T> W2m(d, dff);  // W_2^T diag(mask_t)
    for (index_t k = 0; k < dff; ++k) {
      if (f.H1[t * dff + k] > T(0)) W2m.col(k) = W2.row(k).transpose();
      else W2m.col(k).setZero();  // relu'(0) is taken as 0
    }
    Mat<T> JSY = W2m * W1.transpose();
    JSY.diagonal().array() += T(1);
    for (int p = 0; p < 3; ++p) {
      const index_t r = fa.split[p].n_mat();
      MapM<T> UY(fa.UY[p].data() + t * d * r, d, r);
      UY.noalias() = JY * MapC<T>(fa.UF[p].data() + t * d * r, d, r);
      MapM<T>(fa.US[p].data() + t * d * r, d, r).noalias() = JSY * UY;
    }
    MapM<T>(fa.US[W_1].data() + t * d * dff, d, dff) = W2m;
    MapM<T>(fa.US[W_2].data() + t * d * d, d, d).setIdentity();
  });
  return fa;
}


namespace detail {

// Gamma_t = U_t^T Om_t V_t for per-token matrices stored contiguously.
template <class T>
auto sandwich(const Buffer<T>& U, index_t ru, const Buffer<T>& Om, const Buffer<T>& V, index_t rv, index_t d) {
  return [&U, &Om, &V, ru, rv, d](index_t t, T* out) {
    const MapC<T> Ut(U.data() + t * d * ru, d, ru), Vt(V.data() + t * d * rv, d, rv), O(Om.data() + t * d * d, d, d);
    MapM<T>(out, ru, rv).noalias() = Ut.transpose() * (O * Vt);
  };
}

}  // namespace detail

// Writes the symmetric (P, P) Hessian of the scalar whose cotangents are in `r` and whose outer
// curvature at Z is hessZ (per token d x d; null = none), restricted to the selected parameters.
template <class T>
void assemble_hessian(const Forward<T>& f, const Factors<T>& fa, const Reverse<T>& r,
                      const T* gZ, const T* hessZ, Part part, const Selection& wrt, T* H) {
  const Dims& D = f.dims;
  const index_t L = D.L, d = D.d, dk = D.dk, dff = D.dff, n = f.tokens();
  std::array<index_t, kNumParams> off{};
  const index_t P = offsets(D, wrt, off);
  auto block = [&](int i, int j) { return H + off[i] * P + off[j]; };
  const bool outer = part != Part::functional && hessZ != nullptr;
  const bool functional = part != Part::outer;

  // Curvature at S: J_Z^T H_l J_Z (outer) + the second LayerNorm contracted with gZ (functional).
  Buffer<T> omegaS(n * d * d, T(0)), omegaF;
  blockhess::detail::parallel_for(n, d * d * d, [&](index_t t) {
    MapM<T> Om(omegaS.data() + t * d * d, d, d);
    const T* z = f.Z.data() + t * d;
    if (outer) {
      Mat<T> JZ(d, d);
      layernorm::jacobian_row(z, f.sigma2[t], static_cast<const T*>(nullptr), d, JZ.data());
      Om.noalias() = JZ.transpose() * MapC<T>(hessZ + t * d * d, d, d) * JZ;
    }
    if (functional) {
      Mat<T> C(d, d);
      layernorm::hessian_contract_row(z, f.sigma2[t], static_cast<const T*>(nullptr), gZ + t * d, d, C.data());
      Om += C;
    }
  });
  // This first term reaches every entry of the upper block triangle, so it overwrites H (no zero
  // fill); everything after it adds; the lower triangle is mirrored at the end.
  for (int i = 0; i < kNumParams; ++i)
    for (int j = i; j < kNumParams; ++j)
      if (wrt[i] && wrt[j])
        kron::accumulate(n, fa.split[i], fa.vec[i].data(), fa.split[j], fa.vec[j].data(),
                         detail::sandwich(fa.US[i], fa.split[i].n_mat(), omegaS, fa.US[j], fa.split[j].n_mat(), d),
                         T(1), block(i, j), P, i == j, /*overwrite=*/true);

  if (functional) {
    const T s = f.inv_sqrt_dk();
    // <gY, LN1''[dF, dF]> over the attention weights.
    omegaF.resize(n * d * d);
    blockhess::detail::parallel_for(n, d * d, [&](index_t t) {
      layernorm::hessian_contract_row(f.Y.data() + t * d, f.sigma1[t], static_cast<const T*>(nullptr),
                                      r.gY.data() + t * d, d, omegaF.data() + t * d * d);
    });
    for (int i = 0; i < 3; ++i)
      for (int j = i; j < 3; ++j)
        if (wrt[i] && wrt[j])
          kron::accumulate(n, fa.split[i], fa.vec[i].data(), fa.split[j], fa.vec[j].data(),
                           detail::sandwich(fa.UF[i], fa.split[i].n_mat(), omegaF, fa.UF[j], fa.split[j].n_mat(), d),
                           T(1), block(i, j), P, i == j);

    // 2<gH1, dY dW_1>: (attention, W_1) with gH1 on W_1's columns.
    const kron::Split w1_by_cols{d, dff, false}, w2_by_cols{dff, d, false}, wv_by_cols{d, d, false};
    const MapC<T> W1(f.weight(W_1), d, dff);
    for (int i = 0; i < 3; ++i) {
      const index_t ri = fa.split[i].n_mat();
      if (wrt[i] && wrt[W_1])
        kron::accumulate(n, fa.split[i], fa.vec[i].data(), w1_by_cols, r.gH1.data(),
                         [&](index_t t, T* out) {
                           MapM<T>(out, ri, d) = MapC<T>(fa.UY[i].data() + t * d * ri, d, ri).transpose();
                         },
                         T(1), block(i, W_1), P);
      // 2<gS, dR dW_2>: (attention, W_2) with gS on W_2's columns; dR_t = mask_t * (W_1^T dY_t).
      if (wrt[i] && wrt[W_2])
        kron::accumulate(n, fa.split[i], fa.vec[i].data(), w2_by_cols, r.gS.data(),
                         [&](index_t t, T* out) {
                           MapM<T> G(out, ri, dff);
                           G.noalias() = MapC<T>(fa.UY[i].data() + t * d * ri, d, ri).transpose() * W1;
                           for (index_t k = 0; k < dff; ++k)
                             if (!(f.H1[t * dff + k] > T(0))) G.col(k).setZero();
                         },
                         T(1), block(i, W_2), P);
    }
    // 2<gS, dR dW_2> with dR = mask * (Y dW_1): (W_1, W_2), diagonal in the hidden unit f.
    if (wrt[W_1] && wrt[W_2]) {
      T* B12 = block(W_1, W_2);
      const MapC<T> Y(f.Y.data(), n, d), gS(r.gS.data(), n, d);
      blockhess::detail::parallel_for(dff, n * d * d, [&](index_t k) {
        Mat<T> Ym = Y;
        for (index_t t = 0; t < n; ++t)
          if (!(f.H1[t * dff + k] > T(0))) Ym.row(t).setZero();
        const Mat<T> M = Ym.transpose() * gS;  // (d, d): [b, c]
        for (index_t b = 0; b < d; ++b)
          for (index_t c = 0; c < d; ++c) B12[(b * dff + k) * P + k * d + c] += M(b, c);
      });
    }

    // Attention. Derivatives of the logits row T_t: W_Q -> vector x_t, matrix K/sqrt(dk) (L, dk);
    // W_K -> vector q_t/sqrt(dk), matrix X (L, d).
    auto logit_matrix = [&](int p, index_t b) -> Mat<T> {
      if (p == W_Q) return s * MapC<T>(f.K.data() + b * L * dk, L, dk);
      return MapC<T>(f.X + b * L * d, L, d);
    };
    // <gA, softmax''[dT, dT]>.
    for (int i = 0; i < 2; ++i)
      for (int j = i; j < 2; ++j)
        if (wrt[i] && wrt[j])
          kron::accumulate(n, fa.split[i], fa.vec[i].data(), fa.split[j], fa.vec[j].data(),
                           [&](index_t t, T* out) {
                             const index_t b = t / L;
                             Mat<T> Hs(L, L);
                             softmax::hessian_contract_row(f.A.data() + t * L, r.gA.data() + t * L, L, Hs.data());
                             const Mat<T> Ui = logit_matrix(i, b), Uj = logit_matrix(j, b);
                             MapM<T>(out, Ui.cols(), Uj.cols()).noalias() = Ui.transpose() * Hs * Uj;
                           },
                           T(1), block(i, j), P, i == j);
    // 2<gF, dA dV> with dV = X dW_V: (W_Q or W_K, W_V) with gF on W_V's columns.
    for (int i = 0; i < 2; ++i)
      if (wrt[i] && wrt[W_V])
        kron::accumulate(n, fa.split[i], fa.vec[i].data(), wv_by_cols, r.gF.data(),
                         [&](index_t t, T* out) {
                           const index_t b = t / L;
                           const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> a(f.A.data() + t * L, L);
                           const Mat<T> U = logit_matrix(i, b);
                           const MapC<T> X(f.X + b * L * d, L, d);
                           // U^T Jsm_t X = U^T diag(a) X - (a^T U)^T (a^T X)
                           MapM<T>(out, U.cols(), d).noalias() =
                               U.transpose() * a.asDiagonal() * X - (a.transpose() * U).transpose() * (a.transpose() * X);
                         },
                         T(1), block(i, W_V), P);
    // 2<gT, dQ dK^T>/sqrt(dk): (W_Q, W_K), diagonal in the key index k.
    if (wrt[W_Q] && wrt[W_K]) {
      T* BQK = block(W_Q, W_K);
      Mat<T> M = Mat<T>::Zero(d, d);
      for (index_t b = 0; b < f.B; ++b) {
        const MapC<T> X(f.X + b * L * d, L, d), gT(r.gT.data() + b * L * L, L, L);
        M.noalias() += s * X.transpose() * gT * X;
      }
      for (index_t bq = 0; bq < d; ++bq)
        for (index_t k = 0; k < dk; ++k)
          for (index_t bk = 0; bk < d; ++bk) BQK[(bq * dk + k) * P + bk * dk + k] += M(bq, bk);
    }
  }
  if (!kron::mirror_upper(H, P))  // checks every entry as it mirrors: no extra pass over H
    throw non_finite_error("block: the assembled Hessian (a sum of products of finite factors) is not finite "
                           "(Inf or NaN) although every input is: the inputs drive it past the float range; "
                           "rescale them (weights or inputs of smaller magnitude)");
}

// dZ/dW_p for one sample: (L d, n_p).
template <class T>
void jacobian(const Forward<T>& f, const Factors<T>& fa, int p, T* J) {
  const Dims& D = f.dims;
  const index_t d = D.d, n = f.tokens(), np = D.size(p);
  const kron::Split& sp = fa.split[p];
  const index_t no = sp.n_vec(), nr = sp.n_mat();
  blockhess::detail::parallel_for(n, d * np, [&](index_t t) {
    Mat<T> JZ(d, d);
    layernorm::jacobian_row(f.Z.data() + t * d, f.sigma2[t], static_cast<const T*>(nullptr), d, JZ.data());
    const Mat<T> U = JZ * MapC<T>(fa.US[p].data() + t * d * nr, d, nr);
    const T* v = fa.vec[p].data() + t * no;
    for (index_t a = 0; a < d; ++a) {
      T* row = J + (t * d + a) * np;
      for (index_t o = 0; o < no; ++o)
        for (index_t r = 0; r < nr; ++r) row[sp.flat(o, r)] = v[o] * U(a, r);
    }
  });
}

// d2 Z / dW_i dW_j for one sample, in the paper's layout (L d n_i, n_j): for each output entry o,
// the (i, j) block of the Hessian of Z_o, whose cotangent is the unit vector e_o.
template <class T>
void output_hessian(const Dims& D, const T* X, const Weights<T>& W, T eps, int i, int j, T* out) {
  const Forward<T> f = forward(D, 1, X, W, eps);
  const Factors<T> fa = factorize(f);
  Selection wrt{};
  wrt[i] = wrt[j] = true;
  std::array<index_t, kNumParams> off{};
  const index_t P = offsets(D, wrt, off), ni = D.size(i), nj = D.size(j), m = D.L * D.d;
  Buffer<T> gZ(m, T(0)), H(P * P);
  for (index_t o = 0; o < m; ++o) {
    gZ[o] = T(1);
    const Reverse<T> r = reverse(f, gZ.data());
    assemble_hessian(f, fa, r, gZ.data(), static_cast<const T*>(nullptr), Part::functional, wrt, H.data());
    for (index_t a = 0; a < ni; ++a)
      std::copy_n(H.data() + (off[i] + a) * P + off[j], nj, out + (o * ni + a) * nj);
    gZ[o] = T(0);
  }
}

}  // namespace blockhess::block
