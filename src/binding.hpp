// The one header every binding translation unit includes first: pybind11, the array aliases and
// the small helpers that turn numpy arrays into raw pointers.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/config.hpp"

namespace py = pybind11;

namespace blockhess::bind {

// Strict arrays: C-contiguous, exactly dtype T. Bound with .noconvert(), so a wrong dtype or layout
// raises TypeError here and every copy happens, visibly, in the Python layer.
template <class T>
using carray = py::array_t<T, py::array::c_style>;
template <class T>
using optional_carray = std::optional<carray<T>>;

template <class T>
const T* data_or_null(const optional_carray<T>& a) {
  return a ? a->data() : nullptr;
}

// Defensive re-check of what Python already validated: an array's shape against what the call
// needs (host arrays, and the device arrays _cuda takes as their pointer and shape).
inline void require_shape_of(const std::vector<index_t>& shape, const std::vector<index_t>& expected,
                             const char* name) {
  if (shape != expected) throw std::invalid_argument(std::string("blockhess: array '") + name + "' has the wrong shape");
}
template <class T>
std::vector<index_t> dims(const carray<T>& a) {
  return std::vector<index_t>(a.shape(), a.shape() + a.ndim());
}
template <class T>
void require_shape(const carray<T>& a, std::initializer_list<index_t> shape, const char* name) {
  require_shape_of(dims(a), shape, name);
}

template <class T>
T* mutable_ptr(carray<T>& a) {
  return a.mutable_data();  // throws on a read-only array
}

// Calls f(std::integral_constant<...>) once per supported float type; used to register overloads.
template <class F>
void for_each_float(F&& f) {
  f(static_cast<double*>(nullptr));
  f(static_cast<float*>(nullptr));
}

void bind_layernorm(py::module_& m);
void bind_softmax(py::module_& m);
void bind_commutation(py::module_& m);
void bind_attention(py::module_& m);
void bind_ffn(py::module_& m);
void bind_block(py::module_& m);
void bind_checks(py::module_& m);
void bind_threads(py::module_& m);
void bind_memory(py::module_& m);
void bind_engine(py::module_& m);  // the _engine_nodes test module only
void bind_block_device(py::module_& m);       // the _cuda module only
void bind_components_device(py::module_& m);  // the _cuda module only

}  // namespace blockhess::bind
