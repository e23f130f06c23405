// The row norms' per-token work (engine/nodes/layernorm.hpp: LayerNorm, RMSNorm) as row
// operations (engine/row_ops.hpp): an item is one token's row of width d.
#pragma once

#include "blockhess/config.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/layernorm.hpp"
#include "blockhess/rmsnorm.hpp"

namespace blockhess::engine::rows {

// n_t = the normalised row u_t and scale_t its sigma_t (LayerNorm) or r_t (rms: RMSNorm).
template <class T>
struct NormalizeRows {
  const T* u;
  T* n;
  T* scale;
  index_t d;
  T eps;
  bool rms;
  index_t cost() const { return 4 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t)
      scale[t] = rms ? rmsnorm::normalize_row(u + t * d, d, eps, n + t * d)
                     : layernorm::normalize_row(u + t * d, d, eps, n + t * d);
  }
};

// J_t = diag(gamma) J0_t (gamma null: J0_t), token t's (d, d) Jacobian of its norm, row-major,
// token after token: what a norm's push maps the factors with.
template <class T>
struct NormJacobianRows {
  const T* n;
  const T* scale;
  const T* gamma;
  T* J;
  index_t d;
  bool rms;
  index_t cost() const { return d * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t) {
      if (rms) rmsnorm::jacobian_row(n + t * d, scale[t], gamma, d, J + t * d * d);
      else layernorm::jacobian_row(n + t * d, scale[t], gamma, d, J + t * d * d);
    }
  }
};

// y = gamma * n entry by entry (an item is an entry here): a norm's scale; its shift beta is
// AddBias after it, not fused, so that the host rounds the product before the sum as it always has.
template <class T>
struct ScaleColumns {
  const T* n;
  const T* gamma;
  T* y;
  index_t d;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for_columns(begin, end, d, [this](index_t k, index_t j) { y[k] = n[k] * gamma[j]; });
  }
};

// The tangent of a norm's output: dn_t = J0_t du_t (J0 symmetric: its vjp row); with gamma (affine)
// dy_t = gamma * dn_t + n_t * dgamma + dbeta, each term where it moves (du, dgamma, dbeta null
// where not). Without gamma dn is dy.
template <class T>
struct NormTangentRows {
  const T* n;
  const T* scale;
  const T* du;
  const T* gamma;
  const T* dgamma;
  const T* dbeta;
  T* dn;
  T* dy;
  index_t d;
  bool rms;
  index_t cost() const { return 4 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t t = begin; t < end; ++t) {
      const T* n_t = n + t * d;
      if (du) {
        if (rms) rmsnorm::vjp_row(n_t, scale[t], du + t * d, d, dn + t * d);
        else layernorm::vjp_row(n_t, scale[t], du + t * d, d, dn + t * d);
      }
      if (!gamma) continue;
      T* row = dy + t * d;
      for (index_t a = 0; a < d; ++a)
        row[a] = (du ? gamma[a] * dn[t * d + a] : T(0)) + (dgamma ? n_t[a] * dgamma[a] : T(0)) + (dbeta ? dbeta[a] : T(0));
    }
  }
};

namespace detail {
// The norm's J0^T g of one row (LayerNorm's or RMSNorm's row function).
template <class T>
BLOCKHESS_HD void norm_vjp_row(bool rms, const T* n, T scale, const T* g, index_t d, T* u) {
  if (rms) rmsnorm::vjp_row(n, scale, g, d, u);
  else layernorm::vjp_row(n, scale, g, d, u);
}
// gamma * g into row, or g itself without gamma.
template <class T>
BLOCKHESS_HD const T* scaled_by(const T* gamma, const T* g, index_t d, T* row) {
  if (!gamma) return g;
  for (index_t a = 0; a < d; ++a) row[a] = gamma[a] * g[a];
  return row;
}
}  // namespace detail

// The cotangent of a norm's input, J0^T (gamma * gy) a row, assigned or (add) added to out.
// Scratch: the row of gamma * gy and the row of J0^T before it is added.
template <class T>
struct NormVjpRows {
  const T* n;
  const T* scale;
  const T* gy;
  const T* gamma;
  T* out;
  bool add;
  index_t d;
  bool rms;
  index_t cost() const { return 4 * d; }
  index_t scratch_size() const { return 2 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end, T* scratch) const {
    for (index_t t = begin; t < end; ++t) {
      const T* g_t = detail::scaled_by(gamma, gy + t * d, d, scratch + d);
      T* u = add ? scratch : out + t * d;
      detail::norm_vjp_row(rms, n + t * d, scale[t], g_t, d, u);
      if (add)
        for (index_t a = 0; a < d; ++a) out[t * d + a] += u[a];
    }
  }
};

// The tangent of a norm's input cotangent in a Hessian-vector product (the node's vjp_tangent):
// with g^ = gamma * gy the cotangent of n, J0^T dg^ + (curved) dJ0^T g^, dg^ = gamma * dgy +
// (curved) dgamma * gy; du the input's tangent and dn the normalised rows' (n's tangent), both
// present; assigned or (add) added to out. Scratch: five rows.
template <class T>
struct NormCotangentTangentRows {
  const T* n;
  const T* scale;
  const T* gy;
  const T* dgy;
  const T* gamma;
  const T* dgamma;
  const T* du;
  const T* dn;
  T* out;
  bool add;
  bool curved;
  index_t d;
  bool rms;
  index_t cost() const { return 12 * d; }
  index_t scratch_size() const { return 5 * d; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end, T* scratch) const {
    T *g_hat = scratch, *dg_hat = scratch + d, *u = scratch + 2 * d, *term = scratch + 3 * d, *du_t = scratch + 4 * d;
    for (index_t t = begin; t < end; ++t) {
      const T* n_t = n + t * d;
      const T* gh = detail::scaled_by(gamma, gy + t * d, d, g_hat);
      const T* dgh = detail::scaled_by(gamma, dgy + t * d, d, dg_hat);
      if (curved && dgamma) {
        if (dgh != dg_hat) {
          for (index_t a = 0; a < d; ++a) dg_hat[a] = dgh[a];
          dgh = dg_hat;
        }
        for (index_t a = 0; a < d; ++a) dg_hat[a] += dgamma[a] * gy[t * d + a];
      }
      detail::norm_vjp_row(rms, n_t, scale[t], dgh, d, term);
      if (curved) {
        detail::norm_vjp_row(rms, n_t, scale[t], gh, d, u);  // this node's own J0^T g^
        if (rms) rmsnorm::vjp_tangent_row(n_t, scale[t], gh, u, du + t * d, dn + t * d, d, du_t);
        else layernorm::vjp_tangent_row(n_t, scale[t], gh, u, du + t * d, dn + t * d, d, du_t);
        for (index_t a = 0; a < d; ++a) term[a] += du_t[a];
      }
      T* o = out + t * d;
      for (index_t a = 0; a < d; ++a) o[a] = add ? o[a] + term[a] : term[a];
    }
  }
};

}  // namespace blockhess::engine::rows
