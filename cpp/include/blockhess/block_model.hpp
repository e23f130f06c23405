// The public C++ API of the engine for a block of the family (params.hpp's Spec) evaluated at one
// batch: its output, Jacobians and output second derivatives, and its loss (a head of heads.hpp)
// with the gradient, the dense Hessian (or its outer / functional part) over a selection of
// parameters, the Hessian's exact diagonal, and the Hessian as a matrix-free operator.
//
// This header declares; block_model_impl.hpp defines, on the engine (engine/graph.hpp,
// engine/loss.hpp). Header-only use gets both. A build that compiles the engine once per
// instruction-set level in translation units of its own (the Python modules) defines
// BLOCKHESS_COMPILED for everything else, which then sees these declarations only and instantiates
// none of the engine.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "blockhess/backend.hpp"
#include "blockhess/config.hpp"
#include "blockhess/cpu_backend.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/engine/head.hpp"
#include "blockhess/engine/kronecker_factors.hpp"
#include "blockhess/engine/working_memory.hpp"
#include "blockhess/heads.hpp"
#include "blockhess/params.hpp"

namespace blockhess::engine {
template <class T>
class LossOperator;  // engine/loss.hpp
}  // namespace blockhess::engine

namespace blockhess::block {

using engine::Part;
template <class T>
using Target = heads::Target<T>;

template <class T>
class LossHessianOperator;

// The block at X (samples x L x d, row-major) with the given weights (one row-major array per
// parameters(spec, dims) entry, in that order): the forward pass is run at construction. The
// weights are copied, or with Storage::borrow read in place for the model's lifetime.
template <class T>
class Model {
 public:
  Model(const Spec& spec, const Dims& dims, index_t samples, const T* X, const std::vector<const T*>& weights, T eps,
        engine::Storage storage = engine::Storage::copy);
  // A model of blocks of the spec (params.hpp's Stack: its layers, each on the previous one's
  // output, a final norm; a ViT's patch embedding, class token, positions and classifier, X then
  // (samples x L x patch_dim)); weights: one array per parameters(spec, dims, stack) entry (the
  // input's, each layer's, prefixed "h.<l>.", then ln_f's and the classifier's). Every derivative
  // covers every parameter. A dense Hessian or diagonal is assembled from the per-token factors
  // over the last layer, the final norm and the classifier; a lower layer's parameters, and the
  // input's, reach another block's attention through its input, which the factors do not cover,
  // and their rows and columns are computed from Hessian-vector products (loss_hessian).
  // On `backend` (backend.hpp; it outlives the model), X, the weights and a loss's target in its
  // memory: the host's by default. On a GPU backend the loss, its gradient and the Hessian-vector
  // products (LossHessianOperator) run there; what still runs on the host refuses it
  // (docs/backends.md).
  static Model stack(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples, const T* X,
                     const std::vector<const T*>& weights, T eps, engine::Storage storage = engine::Storage::copy,
                     const Backend<T>& backend = cpu_backend<T>());
  // A language model (stack.vocab > 0) at the token ids (samples x L, each in [0, vocab)): its
  // parameters start with wte (and wpe); with stack.lm_head its output is the logits (tokens, vocab).
  // Dense Hessians and diagonals over wte or wpe come from products like a lower layer's. The ids
  // are in the host's memory (the model copies them to the backend's); the weights and a loss's
  // target in the backend's, as for stack().
  static Model language_model(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples,
                              const std::int64_t* ids, const std::vector<const T*>& weights, T eps,
                              engine::Storage storage = engine::Storage::copy,
                              const Backend<T>& backend = cpu_backend<T>());
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const std::vector<ParamShape>& shapes() const { return shapes_; }
  index_t samples() const { return graph_->samples(); }
  index_t tokens() const { return graph_->tokens(); }
  const T* output() const { return graph_->value(graph_->output()); }  // Z: (tokens, output_width())
  index_t output_width() const { return graph_->width(graph_->output()); }  // d, or the LM head's vocab

  // dZ/dW_p for one sample: (L d, n_p).
  void jacobian(int p, T* J);
  // d2Z / dW_i dW_j for one sample, in the paper's layout (L d n_i, n_j).
  void output_hessian(int i, int j, T* out);
  // The loss; its gradient (every parameter, in the canonical order) into grad unless null.
  T loss_gradient(const Target<T>& target, T* grad);
  // The loss; the (P, P) Hessian (or its part) over the parameters in wrt into H.
  T loss_hessian(const Target<T>& target, Part part, const Selection& wrt, T* H);
  // The loss; the diagonal of that Hessian (P entries) into diag, with no block of it formed. Where
  // the per-token factors do not reach a selected parameter, from P Hessian-vector products
  // (std::invalid_argument above max_products).
  T loss_hessian_diagonal(const Target<T>& target, Part part, const Selection& wrt, T* diag,
                          index_t max_products = std::numeric_limits<index_t>::max());

  // K-FAC's factors (engine/kfac.hpp) of the weights in wrt that the model applies to every token
  // (the attention's W_Q, W_K, W_V, W_O, the FFN's, a patch embedding's, a classifier's, and their
  // biases), K-FAC-expand
  // or (reduce) K-FAC-reduce, in the canonical order.
  std::vector<engine::KroneckerFactors<T>> kfac_factors(const Target<T>& target, const Selection& wrt, bool reduce);

  // What `call` would allocate besides its result, in elements (engine/working_memory.hpp), for
  // the model of these sizes at `samples` samples, without computing anything: the loss's target
  // (null for the calls without one) names its head only, and its arrays are not read. columns:
  // the products' columns; threads: the threads that run them.
  static index_t working_memory(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples,
                                const Target<T>* target, engine::Call call, Part part, const Selection& wrt,
                                index_t columns, index_t threads);

  // The engine graph, for assembly into another target (the GPU's DeviceHessian, engine/loss.hpp).
  engine::Graph<T>& graph() { return *graph_; }

 private:
  friend class LossHessianOperator<T>;
  Model(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples, const T* X, const std::int64_t* ids,
        const std::vector<const T*>& weights, T eps, engine::Storage storage, const Backend<T>& backend);
  std::vector<ParamShape> shapes_;
  std::unique_ptr<engine::Graph<T>> graph_;
};

// The loss Hessian (or its part) over the parameters in wrt as an operator: the forward pass, the
// head and the reverse pass are done once, at construction; every product reuses them, and nothing
// P x P is formed (engine/loss.hpp's LossOperator).
template <class T>
class LossHessianOperator {
 public:
  LossHessianOperator(Model<T>&& model, const Target<T>& target, Part part, const Selection& wrt);
  LossHessianOperator(LossHessianOperator&&) noexcept;
  LossHessianOperator& operator=(LossHessianOperator&&) noexcept;
  ~LossHessianOperator();

  index_t size() const;  // P
  T loss_value() const;
  // out = H v for one vector v of length size().
  void apply(const T* v, T* out) const;
  // out = H V for V of shape (size(), k), both row-major; the columns run in parallel, each
  // computed the same way whichever thread runs it.
  void apply_columns(const T* V, index_t k, T* out) const;

 private:
  std::unique_ptr<engine::LossOperator<T>> op_;
};

}  // namespace blockhess::block

#ifndef BLOCKHESS_COMPILED
#include "blockhess/block_model_impl.hpp"
#endif
