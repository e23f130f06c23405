// The block's parameter registry, the one place that says which parameters exist, what they are
// called, their shapes and their order (the order of a flattened parameter vector and of the rows
// and columns of a dense Hessian). Python's BlockParams reads it through _core.block_parameters.
#pragma once

#include <array>
#include <stdexcept>

#include "blockhess/config.hpp"

namespace blockhess::block {

enum Param : int { W_Q = 0, W_K = 1, W_V = 2, W_1 = 3, W_2 = 4 };
constexpr int kNumParams = 5;
constexpr std::array<const char*, kNumParams> kParamNames{"W_Q", "W_K", "W_V", "W_1", "W_2"};

// The sizes of a block: L tokens of width d, d_k query/key columns, d_ff hidden units.
struct Dims {
  index_t L = 0, d = 0, dk = 0, dff = 0;

  // W_Q, W_K (d, d_k); W_V (d, d); W_1 (d, d_ff); W_2 (d_ff, d).
  index_t rows(int p) const { return p == W_2 ? dff : d; }
  index_t cols(int p) const { return p == W_Q || p == W_K ? dk : p == W_1 ? dff : d; }
  index_t size(int p) const { return rows(p) * cols(p); }
  index_t total_size() const {
    index_t P = 0;
    for (int p = 0; p < kNumParams; ++p) P += size(p);
    return P;
  }
  void check() const {
    if (L < 1 || d < 1 || dk < 1 || dff < 1)
      throw std::invalid_argument("block: L, d, d_k and d_ff must all be >= 1");
  }
};

// The parameters chosen for a derivative (wrt), and where each sits in the flattened vector of
// the chosen ones.
using Selection = std::array<bool, kNumParams>;

// Offsets of the selected parameters in the flattened vector; returns the total size.
inline index_t offsets(const Dims& D, const Selection& wrt, std::array<index_t, kNumParams>& off) {
  index_t total = 0;
  for (int p = 0; p < kNumParams; ++p) {
    off[p] = total;
    if (wrt[p]) total += D.size(p);
  }
  return total;
}

}  // namespace blockhess::block
