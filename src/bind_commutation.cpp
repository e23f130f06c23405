// Bindings for commutation matrices and Kronecker products: the index map, the dense matrix,
// K applied to a vector or to the rows of a matrix, and (A (x) B) vec_r(X) without forming A (x) B.
#include "binding.hpp"

#include <cstdint>

#include "blockhess/commutation.hpp"

namespace blockhess::bind {
namespace {

void require_dims(index_t rows, index_t cols) {
  if (rows < 1 || cols < 1) throw std::invalid_argument("commutation: m and n must be >= 1");
}

template <class T>
void bind_for(py::module_& m) {
  m.def(
      "commutation_dense",
      [](index_t rows, index_t cols, carray<T>& out) {
        require_dims(rows, cols);
        require_shape(out, {rows * cols, rows * cols}, "out");
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        commutation::dense(rows, cols, o);
      },
      py::arg("m"), py::arg("n"), py::arg("out").noconvert());

  // v has m n rows (1-D, or 2-D with any number of columns); out has v's shape.
  m.def(
      "commute",
      [](const carray<T>& v, index_t rows, index_t cols, carray<T>& out) {
        require_dims(rows, cols);
        if (v.ndim() < 1 || v.ndim() > 2 || v.shape(0) != rows * cols)
          throw std::invalid_argument("commute: v must have m*n rows");
        const index_t width = v.ndim() == 2 ? v.shape(1) : 1;
        if (v.ndim() == 2)
          require_shape(out, {rows * cols, width}, "out");
        else
          require_shape(out, {rows * cols}, "out");
        const T* src = v.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        commutation::apply(src, rows, cols, width, o);
      },
      py::arg("v").noconvert(), py::arg("m"), py::arg("n"), py::arg("out").noconvert());

  // out (p q) = vec_r(A X B^T) for A (p, m), B (q, n), X (m, n).
  m.def(
      "kron_apply",
      [](const carray<T>& A, const carray<T>& B, const carray<T>& X, carray<T>& out) {
        if (A.ndim() != 2 || B.ndim() != 2) throw std::invalid_argument("kron_apply: A and B must be 2-D");
        const index_t p = A.shape(0), mm = A.shape(1), q = B.shape(0), n = B.shape(1);
        require_shape(X, {mm, n}, "X");
        require_shape(out, {p * q}, "out");
        const T *a = A.data(), *b = B.data(), *x = X.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        commutation::kron_apply(a, p, mm, b, q, n, x, o);
      },
      py::arg("A").noconvert(), py::arg("B").noconvert(), py::arg("X").noconvert(), py::arg("out").noconvert());
}

}  // namespace

void bind_commutation(py::module_& m) {
  m.def(
      "commutation_permutation",
      [](index_t rows, index_t cols, carray<std::int64_t>& out) {
        require_dims(rows, cols);
        require_shape(out, {rows * cols}, "out");
        std::int64_t* o = mutable_ptr(out);
        py::gil_scoped_release release;
        commutation::permutation(rows, cols, o);
      },
      py::arg("m"), py::arg("n"), py::arg("out").noconvert());
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });
}

}  // namespace blockhess::bind
