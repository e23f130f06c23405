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

}  // namespace blockhess::engine::rows
