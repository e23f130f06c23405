// One weight's K-FAC factors (kfac.hpp computes them): its Gauss-Newton block, in the weight's
// row-major vec order, is approximated by A (x) G.
#pragma once

#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"

namespace blockhess::engine {

template <class T>
struct KroneckerFactors {
  int param = -1;             // the weight's index among the graph's parameters
  index_t rows = 0, cols = 0;  // the weight's shape
  Buffer<T> A, G;             // (rows, rows) and (cols, cols): its inputs' and its outputs' sides (kfac.hpp)
};

}  // namespace blockhess::engine
