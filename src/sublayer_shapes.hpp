// The sublayers' sizes read from their arrays' shapes, and the shape of each result: one reading for
// _core's bindings (bind_attention.cpp, bind_ffn.cpp) and _cuda's (cuda_components.cpp).
#pragma once

#include <stdexcept>
#include <vector>

#include "binding.hpp"
#include "blockhess/components.hpp"

namespace blockhess::bind {

inline components::AttentionDims attention_dims(const std::vector<index_t>& X, const std::vector<index_t>& WQ,
                                                const std::vector<index_t>& WK, const std::vector<index_t>& WV) {
  if (X.size() != 2 || WQ.size() != 2 || WV.size() != 2)
    throw std::invalid_argument("attention: X, W_Q, W_K and W_V must be 2-D");
  const components::AttentionDims s{X[0], X[1], WQ[1], WV[1]};
  require_shape_of(WQ, {s.d, s.dk}, "W_Q");
  require_shape_of(WK, {s.d, s.dk}, "W_K");
  require_shape_of(WV, {s.d, s.dv}, "W_V");
  return s;
}

// The attention's F (L, d_v).
inline std::vector<index_t> attention_forward_shape(const components::AttentionDims& s) { return {s.L, s.dv}; }

// wrt (components::AttentionWrt): 0 = W_Q, 1 = W_K, 2 = W_V, 3 = X; (L d_v, columns(s, wrt))
inline std::vector<index_t> attention_jacobian_shape(const components::AttentionDims& s, int wrt) {
  if (wrt < 0 || wrt > 3) throw std::invalid_argument("attention_jacobian: wrt must be 0..3");
  return {s.L * s.dv, components::columns(s, static_cast<components::AttentionWrt>(wrt))};
}

inline components::FfnDims ffn_dims(const std::vector<index_t>& Y, const std::vector<index_t>& W1,
                                    const std::vector<index_t>& W2) {
  if (Y.size() != 2 || W1.size() != 2 || W2.size() != 2) throw std::invalid_argument("ffn: Y, W_1 and W_2 must be 2-D");
  const components::FfnDims s{Y[0], Y[1], W1[1], W2[1]};
  require_shape_of(W1, {s.d, s.f}, "W_1");
  require_shape_of(W2, {s.f, s.e}, "W_2");
  return s;
}

// The forward pass's F (L, e).
inline std::vector<index_t> ffn_forward_shape(const components::FfnDims& s) { return {s.L, s.e}; }

// kind (components::FfnJacobian): 0 = W_1 (L e, d f), 1 = W_2 (L e, f e), 2 = Y dense (L e, L d),
// 3 = Y blocks (L, e, d), 4 = W_1 Kronecker factor (L, e, f), 5 = W_2 Kronecker factor relu(Y W_1) (L, f)
inline std::vector<index_t> ffn_jacobian_shape(const components::FfnDims& s, int kind) {
  switch (kind) {
    case 0: return {s.L * s.e, s.d * s.f};
    case 1: return {s.L * s.e, s.f * s.e};
    case 2: return {s.L * s.e, s.L * s.d};
    case 3: return {s.L, s.e, s.d};
    case 4: return {s.L, s.e, s.f};
    case 5: return {s.L, s.f};
    default: throw std::invalid_argument("ffn_jacobian: unknown kind");
  }
}

// kind (components::FfnCross): 0 = blocks (L, d, f), 1 = dense ((L e d f), f e)
inline std::vector<index_t> ffn_cross_shape(const components::FfnDims& s, int kind) {
  if (kind == 0) return {s.L, s.d, s.f};
  if (kind == 1) return {s.L * s.e * s.d * s.f, s.f * s.e};
  throw std::invalid_argument("ffn_cross_hessian: unknown kind");
}

}  // namespace blockhess::bind
