// Row operations (engine/row_ops.hpp) on the per-token tangent factors (engine/factor.hpp): the
// pushes through a linear map, a pointwise map and a sum, and the Jacobians read from a factor.
//
// A factor's G_t is the identity, a diagonal (tokens, cols) or dense, stored column by column
// (tokens, cols, width): entry (i, c) of G_t at (t cols + c) width + i. Each op computes what the
// host's per-token Eigen expressions did, one multiply or one add an entry, so the host's results
// keep their bits.
#pragma once

#include <cstdint>

#include "blockhess/config.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::engine::rows {

// How a factor's G_t (or U_t) is laid out, for the ops that read it.
enum class FactorLayout : int {
  identity = 0,   // G_t = I
  diagonal = 1,   // (tokens, cols): the diagonals
  by_columns = 2, // (tokens, cols, width): G_t column by column, as a dense factor keeps it
  by_rows = 3,    // (tokens, width, cols): U_t row by row (U_t = G_t R_t, its right factor applied)
};

// Entry (i, c) of token t's G_t (width rows, cols columns) in `layout`.
template <class T>
BLOCKHESS_HD T factor_entry(FactorLayout layout, const T* G, index_t t, index_t i, index_t c, index_t width,
                            index_t cols) {
  switch (layout) {
    case FactorLayout::identity: return i == c ? T(1) : T(0);
    case FactorLayout::diagonal: return i == c ? G[t * cols + c] : T(0);
    case FactorLayout::by_columns: return G[(t * cols + c) * width + i];
    default: return G[(t * width + i) * cols + c];
  }
}

// out = value: a bias's vec [1].
template <class T>
struct Fill {
  T* out;
  T value;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = value;
  }
};

// G'_t^T = diag(d_t) W for G_t = diag(d_t) (D, (tokens, cols)) or the identity (D null), W
// (cols, w_out) row-major: a linear map's push of an identity or diagonal factor. An item is a row
// t cols + k of the (tokens cols, w_out) result.
template <class T>
struct WeightRows {
  const T* D;
  const T* W;
  T* out;
  index_t cols, w_out;
  index_t cost() const { return w_out; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t row = begin; row < end; ++row) {
      const T scale = D ? D[row] : T(1);
      const T* w = W + (row % cols) * w_out;
      T* o = out + row * w_out;
      for (index_t j = 0; j < w_out; ++j) o[j] = scale * w[j];
    }
  }
};

// G'_t = diag(m_t) G_t for a per-token mask or scale m (tokens, width): a pointwise map's push.
// by_columns: G (tokens, cols, width) dense, an item a column (t, c), the result dense; else G_t
// the identity (G null) or diagonal (G (tokens, cols)), an item an entry (t, k) of the result's
// diagonal.
template <class T>
struct ScaleFactorRows {
  const T* m;
  const T* G;
  T* out;
  index_t width, cols;
  bool by_columns;
  index_t cost() const { return by_columns ? width : 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t item = begin; item < end; ++item) {
      const index_t t = item / cols;
      if (by_columns) {
        const T* mt = m + t * width;
        for (index_t i = 0; i < width; ++i) out[item * width + i] = mt[i] * G[item * width + i];
      } else {
        out[item] = m[t * width + item % cols] * (G ? G[item] : T(1));
      }
    }
  }
};

// G'_t = J_t G_t for G_t the identity (D null) or diag(D_t) (D (tokens, cols)), with J (tokens,
// width, width) row-major: a norm's push of such a factor (a dense G_t is one product a token).
// An item is a column (t, c) of G'_t: column c of J_t, times D_t[c].
template <class T>
struct JacobianColumns {
  const T* J;
  const T* D;
  T* out;
  index_t width, cols;
  index_t cost() const { return width; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t item = begin; item < end; ++item) {
      const T* Jt = J + (item / cols) * width * width + item % cols;
      T* o = out + item * width;
      if (D)
        for (index_t i = 0; i < width; ++i) o[i] = Jt[i * width] * D[item];
      else
        for (index_t i = 0; i < width; ++i) o[i] = Jt[i * width];
    }
  }
};

// U_t = diag(D_t) R_t, row by row (tokens, width, n): a diagonal factor's right factor applied, as
// FactorOuterRows reads it (by_rows). An item is a row (t, a).
template <class T>
struct DiagonalTimesRows {
  const T* D;
  const T* R;
  T* U;
  index_t n;
  index_t cost() const { return n; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t row = begin; row < end; ++row)
      for (index_t r = 0; r < n; ++r) U[row * n + r] = D[row] * R[row * n + r];
  }
};

// G_t = A_t + B_t, dense (tokens, cols, width), each of A_t, B_t in its layout: the push of a sum
// of two values that a parameter reaches along two paths. An item is a column (t, c): the full
// sides' entries added (by columns, or U_t by rows where a side's R_t was applied; an identity's or
// diagonal's zeros as +0, as the host materialised them), then the entry on the diagonal.
template <class T>
struct AddFactors {
  const T* A;
  FactorLayout a_layout;
  const T* B;
  FactorLayout b_layout;
  T* out;
  index_t width, cols;
  index_t cost() const { return width; }
  // Column (t, c) of a full side, `stride` apart; null for an identity or a diagonal.
  BLOCKHESS_HD const T* column(FactorLayout layout, const T* G, index_t item, index_t& stride) const {
    stride = layout == FactorLayout::by_rows ? cols : 1;
    if (layout == FactorLayout::by_columns) return G + item * width;
    if (layout == FactorLayout::by_rows) return G + (item / cols) * width * cols + item % cols;
    return nullptr;
  }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t item = begin; item < end; ++item) {
      const index_t t = item / cols, c = item % cols;
      T* o = out + item * width;
      index_t as = 1, bs = 1;
      const T* a = column(a_layout, A, item, as);
      const T* b = column(b_layout, B, item, bs);
      if (a && b)
        for (index_t i = 0; i < width; ++i) o[i] = a[i * as] + b[i * bs];
      else if (a)
        for (index_t i = 0; i < width; ++i) o[i] = a[i * as] + T(0);
      else if (b)
        for (index_t i = 0; i < width; ++i) o[i] = T(0) + b[i * bs];
      else
        for (index_t i = 0; i < width; ++i) o[i] = T(0);
      if ((!a || !b) && c < width)
        o[c] = factor_entry(a_layout, A, t, c, c, width, cols) + factor_entry(b_layout, B, t, c, c, width, cols);
    }
  }
};

// The rows of a Jacobian that a factor gives, token by token (docs/derivation.md §4.2): row
// t width + a of `out`, whose rows are row_length long, holds vec_t (x) U_t[a, :] at the columns
// of the parameter's block (kron::Split: offset, stride, vec_on_first), entry by entry
// vec_t[o] U_t[a, r] (vec null: U_t[a, r]). An item is a row (t, a), so that a GPU runs a thread a
// row, not a token; its scratch holds that row of U_t, so that the inner loops run over contiguous
// entries. marks[t width + a] (marks null: no check) is then 0, or one of the row's entries that is
// Inf or NaN: the result's finiteness, checked where it is written.
template <class T>
struct FactorOuterRows {
  const T* vec;
  const T* U;
  FactorLayout layout;
  index_t width, n_vec, n_mat;
  T* out;
  index_t row_length, offset, stride;
  bool vec_on_first;
  T* marks;
  index_t cost() const { return n_vec * n_mat; }
  index_t scratch_size() const { return n_mat; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end, T* u) const {
    for (index_t item = begin; item < end; ++item) {
      const index_t t = item / width, a = item % width;
      const T* v = vec ? vec + t * n_vec : nullptr;
      for (index_t r = 0; r < n_mat; ++r) u[r] = factor_entry(layout, U, t, a, r, width, n_mat);
      T* row = out + item * row_length + offset;
      if (!v)  // n_vec is 1
        for (index_t r = 0; r < n_mat; ++r) row[r] = u[r];
      else if (vec_on_first)  // W[o, r]: runs of r
        for (index_t o = 0; o < n_vec; ++o) scaled(row + o * stride, u, v[o], n_mat);
      else  // W[r, o]: runs of o
        for (index_t r = 0; r < n_mat; ++r) scaled(row + r * stride, v, u[r], n_vec);
      if (!marks) continue;
      marks[item] = T(0);
      if (largest_written(row) == kExponentMask<T>) mark_non_finite(item, row);
    }
  }

 private:
  // run[k] = x[k] s for k < n.
  BLOCKHESS_HD static void scaled(T* run, const T* x, T s, index_t n) {
    for (index_t k = 0; k < n; ++k) run[k] = x[k] * s;
  }

  // The largest exponent field among the entries written from `row` (finite.hpp), while they are in
  // cache: at once where its runs are contiguous, else (a piece of a split parameter, whose columns
  // interleave with the other pieces', not written yet) run by run.
  BLOCKHESS_HD std::uint32_t largest_written(const T* row) const {
    const index_t run_length = vec_on_first ? n_mat : n_vec, runs = vec_on_first ? n_vec : n_mat;
    if (stride == run_length) return largest_exponent(row, runs * run_length);
    std::uint32_t largest = 0;
    for (index_t k = 0; k < runs; ++k) largest = largest_exponent(row + k * stride, run_length, largest);
    return largest;
  }

  // marks[item] = one of the row's entries that is Inf or NaN (rare: an error follows).
  BLOCKHESS_HD void mark_non_finite(index_t item, const T* row) const {
    for (index_t o = 0; o < n_vec; ++o)
      for (index_t r = 0; r < n_mat; ++r) {
        const T* x = row + (vec_on_first ? o * stride + r : r * stride + o);
        if (largest_exponent(x, 1) == kExponentMask<T>) marks[item] = *x;
      }
  }
};

// The FFN's dense cross second derivative from its values C (L, d f) (docs/derivation.md §3.4,
// erratum E4): row (t e + c) d f + j of `out`, f e entries, is zero but for entry (j mod f) e + c,
// which is C[t, j]. An item is a row.
template <class T>
struct CrossLayoutRows {
  const T* C;
  T* out;
  index_t d, f, e;
  index_t cost() const { return f * e; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    const index_t df = d * f;
    for (index_t row = begin; row < end; ++row) {
      const index_t te = row / df, j = row % df;
      T* o = out + row * f * e;
      for (index_t k = 0; k < f * e; ++k) o[k] = T(0);
      o[(j % f) * e + te % e] = C[(te / e) * df + j];
    }
  }
};

// The dense (tokens r, tokens c) block-diagonal matrix of blocks (tokens, r, c): row q holds row q
// of its token's block at that token's columns, zeros elsewhere. An item is a row.
template <class T>
struct BlockDiagonalRows {
  const T* blocks;
  T* out;
  index_t tokens, r, c;
  index_t cost() const { return tokens * c; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t row = begin; row < end; ++row) {
      T* o = out + row * tokens * c;
      const index_t at = (row / r) * c;
      for (index_t k = 0; k < tokens * c; ++k) o[k] = k >= at && k < at + c ? blocks[row * c + k - at] : T(0);
    }
  }
};

// out (rows, width) = 1 in column `column`, 0 elsewhere: the tangent that moves one feature of
// every token at once.
template <class T>
struct UnitColumn {
  T* out;
  index_t width, column;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k] = k % width == column ? T(1) : T(0);
  }
};

// out[k stride] = x[k]: a tangent written as a column of a matrix `stride` wide.
template <class T>
struct WriteStrided {
  const T* x;
  T* out;
  index_t stride;
  index_t cost() const { return 1; }
  BLOCKHESS_HD void operator()(index_t begin, index_t end) const {
    for (index_t k = begin; k < end; ++k) out[k * stride] = x[k];
  }
};

}  // namespace blockhess::engine::rows
