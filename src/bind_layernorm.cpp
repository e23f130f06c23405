// Bindings for LayerNorm: forward, Jacobian (blocks / dense / gamma / beta), second derivative
// (blocks / dense / contraction). Outputs are allocated in Python and written in place.
#include "binding.hpp"

#include <vector>

#include "blockhess/finite.hpp"
#include "blockhess/layernorm.hpp"

namespace blockhess::bind {
namespace {

template <class T>
struct Normalized {
  std::vector<T> y, sigma;
};

// X must be (L, d) and gamma, beta, when given, (d,): checked before anything is read or written.
template <class T>
void check_inputs(const carray<T>& X, const optional_carray<T>& gamma, const optional_carray<T>& beta) {
  if (X.ndim() != 2) throw std::invalid_argument("layernorm: X must be 2-D (L, d)");
  if (gamma) require_shape(*gamma, {X.shape(1)}, "gamma");
  if (beta) require_shape(*beta, {X.shape(1)}, "beta");
}

template <class T>
Normalized<T> normalized(const carray<T>& X, T eps) {
  const index_t L = X.shape(0), d = X.shape(1);
  Normalized<T> n{std::vector<T>(static_cast<size_t>(L * d)), std::vector<T>(static_cast<size_t>(L))};
  layernorm::normalize(X.data(), L, d, eps, n.y.data(), n.sigma.data());
  return n;
}

template <class T>
void bind_for(py::module_& m) {
  using opt = optional_carray<T>;
  m.def(
      "layernorm_forward",
      [](const carray<T>& X, T eps, const opt& gamma, const opt& beta, carray<T>& out) {
        check_inputs(X, gamma, beta);
        const index_t L = X.shape(0), d = X.shape(1);
        require_shape(out, {L, d}, "out");
        T* z = mutable_ptr(out);
        py::gil_scoped_release release;
        std::vector<T> sigma(static_cast<size_t>(L));
        FiniteRecord finite;
        layernorm::forward(X.data(), L, d, eps, data_or_null(gamma), data_or_null(beta), z, sigma.data(), &finite);
        finite.require<T>("LN(X)");
      },
      py::arg("X").noconvert(), py::arg("eps"), py::arg("gamma").noconvert().none(true),
      py::arg("beta").noconvert().none(true), py::arg("out").noconvert());

  // kind: 0 = blocks (L,d,d), 1 = dense (Ld, Ld), 2 = d/dgamma (Ld, d), 3 = d/dbeta (Ld, d)
  m.def(
      "layernorm_jacobian",
      [](const carray<T>& X, T eps, const opt& gamma, int kind, carray<T>& out) {
        check_inputs(X, gamma, opt());
        const index_t L = X.shape(0), d = X.shape(1);
        switch (kind) {
          case 0: require_shape(out, {L, d, d}, "out"); break;
          case 1: require_shape(out, {L * d, L * d}, "out"); break;
          case 2:
          case 3: require_shape(out, {L * d, d}, "out"); break;
          default: throw std::invalid_argument("layernorm_jacobian: unknown kind");
        }
        T* o = mutable_ptr(out);
        const T* g = data_or_null(gamma);
        py::gil_scoped_release release;
        const auto n = normalized(X, eps);
        // gamma/beta Jacobians hold y (|y| <= sqrt(d)) and ones: always finite.
        FiniteRecord finite;
        FiniteRecord* check = layernorm::jacobian_certainly_finite(n.sigma.data(), g, L, d) ? nullptr : &finite;
        switch (kind) {
          case 0: layernorm::jacobian_blocks(n.y.data(), n.sigma.data(), g, L, d, o, check); break;
          case 1: layernorm::jacobian_dense(n.y.data(), n.sigma.data(), g, L, d, o, check); break;
          case 2: layernorm::jacobian_gamma(n.y.data(), L, d, o); break;
          case 3: layernorm::jacobian_beta<T>(L, d, o); break;
          default: throw std::invalid_argument("layernorm_jacobian: unknown kind");
        }
        finite.require<T>(kind == 0 ? "the LayerNorm Jacobian blocks" : "the dense LayerNorm Jacobian");
      },
      py::arg("X").noconvert(), py::arg("eps"), py::arg("gamma").noconvert().none(true), py::arg("kind"),
      py::arg("out").noconvert());

  // kind: 0 = blocks (L,d,d,d), 1 = dense ((Ld)^2, Ld)
  m.def(
      "layernorm_hessian",
      [](const carray<T>& X, T eps, const opt& gamma, int kind, carray<T>& out) {
        check_inputs(X, gamma, opt());
        const index_t L = X.shape(0), d = X.shape(1);
        if (kind == 0)
          require_shape(out, {L, d, d, d}, "out");
        else if (kind == 1)
          require_shape(out, {L * d * L * d, L * d}, "out");
        else
          throw std::invalid_argument("layernorm_hessian: unknown kind");
        T* o = mutable_ptr(out);
        const T* g = data_or_null(gamma);
        py::gil_scoped_release release;
        const auto n = normalized(X, eps);
        FiniteRecord finite;
        if (kind == 0) {
          layernorm::hessian_blocks(n.y.data(), n.sigma.data(), g, L, d, o, &finite);
        } else if (kind == 1) {
          std::vector<T> scratch(static_cast<size_t>(d * d * d));
          layernorm::hessian_dense(n.y.data(), n.sigma.data(), g, L, d, o, scratch.data(), &finite);
        } else {
          throw std::invalid_argument("layernorm_hessian: unknown kind");
        }
        finite.require<T>(kind == 0 ? "the LayerNorm second-derivative blocks" : "the dense LayerNorm second derivative");
      },
      py::arg("X").noconvert(), py::arg("eps"), py::arg("gamma").noconvert().none(true), py::arg("kind"),
      py::arg("out").noconvert());

  m.def(
      "layernorm_hessian_contract",
      [](const carray<T>& X, T eps, const opt& gamma, const carray<T>& G, carray<T>& out) {
        check_inputs(X, gamma, opt());
        const index_t L = X.shape(0), d = X.shape(1);
        require_shape(G, {L, d}, "G");
        require_shape(out, {L, d, d}, "out");
        T* o = mutable_ptr(out);
        const T* g = data_or_null(gamma);
        py::gil_scoped_release release;
        const auto n = normalized(X, eps);
        FiniteRecord finite;
        layernorm::hessian_contract(n.y.data(), n.sigma.data(), g, G.data(), L, d, o, &finite);
        finite.require<T>("the contracted LayerNorm second derivative");
      },
      py::arg("X").noconvert(), py::arg("eps"), py::arg("gamma").noconvert().none(true),
      py::arg("G").noconvert(), py::arg("out").noconvert());
}

}  // namespace

void bind_layernorm(py::module_& m) {
  for_each_float([&](auto* tag) { bind_for<std::remove_pointer_t<decltype(tag)>>(m); });

  m.def(
      "layernorm_working_memory",
      [](index_t L, index_t d, bool dense_hessian) -> index_t {
        if (L < 0 || d < 0) throw std::invalid_argument("layernorm_working_memory: L and d must be >= 0");
        // normalized()'s y (L, d) and sigma (L); the dense second derivative's (d, d, d) scratch.
        return L * d + L + (dense_hessian ? d * d * d : 0);
      },
      py::arg("L"), py::arg("d"), py::arg("dense_hessian"),
      "Elements a LayerNorm call allocates besides its result.");
}

}  // namespace blockhess::bind
