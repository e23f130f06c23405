// Bindings for the row softmax: forward, Jacobian (blocks / dense), second derivative
// (blocks / dense). Outputs are allocated in Python and written in place.
#include "binding.hpp"

#include <vector>

#include "blockhess/softmax.hpp"

namespace blockhess::bind {
namespace {

template <class T>
void bind_for(py::module_& m) {
  m.def(
      "softmax_forward",
      [](const carray<T>& Tm, carray<T>& out) {
        if (Tm.ndim() != 2) throw std::invalid_argument("softmax: T must be 2-D (m, n)");
        const index_t rows = Tm.shape(0), n = Tm.shape(1);
        require_shape(out, {rows, n}, "out");
        const T* t = Tm.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        softmax::forward(t, rows, n, o);
      },
      py::arg("T").noconvert(), py::arg("out").noconvert());

  // kind: 0 = blocks (m, n, n), 1 = dense (m n, m n)
  m.def(
      "softmax_jacobian",
      [](const carray<T>& Tm, int kind, carray<T>& out) {
        if (Tm.ndim() != 2) throw std::invalid_argument("softmax: T must be 2-D (m, n)");
        const index_t rows = Tm.shape(0), n = Tm.shape(1);
        if (kind == 0)
          require_shape(out, {rows, n, n}, "out");
        else if (kind == 1)
          require_shape(out, {rows * n, rows * n}, "out");
        else
          throw std::invalid_argument("softmax_jacobian: unknown kind");
        const T* t = Tm.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        std::vector<T> A(static_cast<size_t>(rows * n));
        softmax::forward(t, rows, n, A.data());
        if (kind == 0)
          softmax::jacobian_blocks(A.data(), rows, n, o);
        else
          softmax::jacobian_dense(A.data(), rows, n, o);
      },
      py::arg("T").noconvert(), py::arg("kind"), py::arg("out").noconvert());

  // kind: 0 = blocks (m, n, n, n), 1 = dense ((m n)^2, m n)
  m.def(
      "softmax_hessian",
      [](const carray<T>& Tm, int kind, carray<T>& out) {
        if (Tm.ndim() != 2) throw std::invalid_argument("softmax: T must be 2-D (m, n)");
        const index_t rows = Tm.shape(0), n = Tm.shape(1), N = rows * n;
        if (kind == 0)
          require_shape(out, {rows, n, n, n}, "out");
        else if (kind == 1)
          require_shape(out, {N * N, N}, "out");
        else
          throw std::invalid_argument("softmax_hessian: unknown kind");
        const T* t = Tm.data();
        T* o = mutable_ptr(out);
        py::gil_scoped_release release;
        std::vector<T> A(static_cast<size_t>(N));
        softmax::forward(t, rows, n, A.data());
        if (kind == 0)
          softmax::hessian_blocks(A.data(), rows, n, o);
        else
          softmax::hessian_dense(A.data(), rows, n, o);
      },
      py::arg("T").noconvert(), py::arg("kind"), py::arg("out").noconvert());
}

}  // namespace

void bind_softmax(py::module_& m) {
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });

  m.def(
      "softmax_working_memory",
      [](index_t rows, index_t n) -> index_t {
        if (rows < 0 || n < 0) throw std::invalid_argument("softmax_working_memory: rows and n must be >= 0");
        return rows * n;  // the probabilities A its derivatives are formed from
      },
      py::arg("rows"), py::arg("n"), "Elements a softmax derivative allocates besides its result.");
}

}  // namespace blockhess::bind
