// Row operations (engine/row_ops.hpp) entry by entry, shared by the nodes: an item is one entry
// of the (tokens, width) arrays.
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"

namespace blockhess::engine::rows {

// entry(k, j) for the entries k in [begin, end) of rows of `width` entries, j the column of k: a
// division a row, not one an entry, and an inner loop over the columns the compiler vectorises.
template <class Entry>
BLOCKHESS_HD void for_columns(index_t begin, index_t end, index_t width, const Entry& entry) {
  for (index_t k = begin; k < end;) {
    const index_t j0 = k % width, stop = end - k < width - j0 ? end - k : width - j0;
    for (index_t j = 0; j < stop; ++j) entry(k + j, j0 + j);
    k += stop;
  }
}

// out = scale * x, assigned or (add) added: a diagonal Jacobian and its transpose.
template <class T>
struct ScaleEntries {
  const T* scale;
  const T* x;
  T* out;
  bool add;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const T v = scale[k] * x[k];
      out[k] = add ? out[k] + v : v;
    }
  }
};

// out = 0: a tangent nothing moves, a gradient that is exactly zero.
template <class T>
struct Zero {
  T* out;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = T(0);
  }
};

// out = a + b: a residual connection and its tangent.
template <class T>
struct SumEntries {
  const T* a;
  const T* b;
  T* out;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = a[k] + b[k];
  }
};

// out = alpha * x entry by entry (an item is an entry; in place where out is x): the mean squared
// error's second derivative, 2/(B L d) I, applied to a tangent; the attention's scale s of Mq_t.
template <class T>
struct ScaleBy {
  T alpha;
  const T* x;
  T* out;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = alpha * x[k];
  }
};

// out = x, or (add) out += x: a value's cotangent share written into its slot.
template <class T>
struct WriteEntries {
  const T* x;
  T* out;
  bool add;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    if (add)
      for (index_t k = begin; k < end; ++k) out[k] += x[k];
    else
      for (index_t k = begin; k < end; ++k) out[k] = x[k];
  }
};

// out (rows, cols) = the matrix whose column k is row k of x, `stride` apart ((cols, rows) rows):
// a weight given by columns laid out by rows (the LM head's W_E^T, for a factor that reads rows
// of it). An item is a row of out.
template <class T>
struct TransposeRows {
  const T* x;
  T* out;
  index_t rows, cols, stride;
  index_t cost() const { return cols; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t r = begin; r < end; ++r)
      for (index_t c = 0; c < cols; ++c) out[r * cols + c] = x[c * stride + r];
  }
};

// out_t += b for every token t, b a row of `width` entries: a bias.
template <class T>
struct AddBias {
  const T* bias;
  T* out;
  index_t width;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for_columns(begin, end, width, [this](index_t k, index_t j) { out[k] += bias[j]; });
  }
};

// out = the column sums of a (rows, cols), or of a * b entry by entry (b not null), assigned or
// (accumulate) added; an item is a column, summed row after row: a bias's or gamma's gradient.
template <class T>
struct ColumnSums {
  const T* a;
  const T* b;
  T* out;
  index_t rows, cols;
  bool accumulate;
  index_t cost() const { return rows; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    if (!accumulate)
      for (index_t c = begin; c < end; ++c) out[c] = T(0);
    // Row by row over the range's columns: each column still sums its rows in order, and the
    // host streams through memory instead of striding down a column.
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = begin; c < end; ++c) out[c] += b ? a[r * cols + c] * b[r * cols + c] : a[r * cols + c];
  }
};

// out_b = sum_t x_b,t, x (samples, L, width) (an item is an entry of out, summed token after
// token): a sample's rows summed.
template <class T>
struct SampleSums {
  const T* x;
  T* out;
  index_t L, width;
  index_t cost() const { return L; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) {
      const index_t b = k / width, a = k % width;
      T s = 0;
      for (index_t t = 0; t < L; ++t) s += x[(b * L + t) * width + a];
      out[k] = s;
    }
  }
};

// A class token's rows (an item is an entry): in every sample (`period` entries apart) the first
// row's d entries are token's (0 where token is null), the others x's (0 where x is null);
// assigned or (add) added: its forward pass, tangent and (token null) cotangent.
template <class T>
struct ClassTokenRows {
  const T* token;
  const T* x;
  T* out;
  bool add;
  index_t period, d;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for_columns(begin, end, period, [this](index_t k, index_t j) {
      const T v = j < d ? (token ? token[j] : T(0)) : (x ? x[k] : T(0));
      out[k] = add ? out[k] + v : v;
    });
  }
};

// out's row t = table's row ids[t], rows of `width` entries (an item is an entry of out): an
// embedding's lookup and its tangent.
template <class T>
struct GatherRows {
  const T* table;
  const std::int64_t* ids;
  T* out;
  index_t width;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for_columns(begin, end, width, [this](index_t k, index_t j) { out[k] = table[ids[k / width] * width + j]; });
  }
};

// Every token's row of `rows` added onto the table's row of its id: an embedding's gradient. The
// tokens come grouped by id (`order`, the tokens of used[u] at [starts[u], starts[u + 1]), each
// group in token order), and an item is an entry of a used row, which sums its tokens in that
// order: deterministic on any backend, and the host's order, so its bits.
template <class T>
struct ScatterRows {
  const T* rows;
  const std::int64_t* used;    // the table's rows some token looks up
  const std::int64_t* starts;  // (used rows + 1) offsets into order
  const std::int64_t* order;   // the tokens, grouped by id
  T* table;
  index_t width;
  index_t tokens_per_row;  // on average: an item's work
  index_t cost() const { return tokens_per_row; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for_columns(begin, end, width, [this](index_t k, index_t j) {
      const index_t u = k / width;
      T* entry = table + used[u] * width + j;
      T sum = *entry;
      for (std::int64_t i = starts[u]; i < starts[u + 1]; ++i) sum += rows[order[i] * width + j];
      *entry = sum;
    });
  }
};

}  // namespace blockhess::engine::rows
