// The definitions behind block_model.hpp: the block wired onto an engine graph (blocks/), and each
// member one call of the engine (engine/derivatives.hpp, engine/loss.hpp) with the loss's head
// made by the registry (heads.hpp).
#pragma once

#include <stdexcept>
#include <utility>

#include "blockhess/block_model.hpp"
#include "blockhess/blocks/family.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/kfac.hpp"
#include "blockhess/engine/loss.hpp"

namespace blockhess::block {

template <class T>
Model<T>::Model(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples, const T* X,
                const std::int64_t* ids, const std::vector<const T*>& weights, T eps, engine::Storage storage,
                const Backend<T>& backend)
    : shapes_(parameters(spec, dims, stack)) {
  dims.check(!spec.attention_only);
  graph_ = std::make_unique<engine::Graph<T>>(samples, dims.L, backend);
  blocks::wire_stack(*graph_, spec, dims, stack, blocks::Input<T>{X, ids}, weights, eps, storage);
  graph_->forward();
}
template <class T>
Model<T>::Model(const Spec& spec, const Dims& dims, index_t samples, const T* X, const std::vector<const T*>& weights,
                T eps, engine::Storage storage)
    : Model(spec, dims, Stack{}, samples, X, nullptr, weights, eps, storage, cpu_backend<T>()) {}
template <class T>
Model<T> Model<T>::stack(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples, const T* X,
                         const std::vector<const T*>& weights, T eps, engine::Storage storage,
                         const Backend<T>& backend) {
  if (stack.reads_tokens()) throw std::invalid_argument("model: a language model reads token ids (language_model)");
  return Model(spec, dims, stack, samples, X, nullptr, weights, eps, storage, backend);
}
template <class T>
Model<T> Model<T>::language_model(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples,
                                  const std::int64_t* ids, const std::vector<const T*>& weights, T eps,
                                  engine::Storage storage, const Backend<T>& backend) {
  if (!stack.reads_tokens()) throw std::invalid_argument("model: token ids need a stack with an embedding (vocab > 0)");
  return Model(spec, dims, stack, samples, nullptr, ids, weights, eps, storage, backend);
}
template <class T>
index_t Model<T>::working_memory(const Spec& spec, const Dims& dims, const Stack& stack, index_t samples,
                                 const Target<T>* target, engine::Call call, Part part, const Selection& wrt,
                                 index_t columns, index_t threads) {
  dims.check(!spec.attention_only);
  engine::Graph<T> g(samples, dims.L);
  const std::vector<const T*> no_weights(parameters(spec, dims, stack).size(), nullptr);
  blocks::wire_stack(g, spec, dims, stack, blocks::Input<T>{nullptr, nullptr, true}, no_weights, T(0),
                     engine::Storage::borrow);
  if (wrt.size() != static_cast<size_t>(g.num_params()))
    throw std::invalid_argument("block: wrt needs one flag per parameter (" + std::to_string(g.num_params()) + ")");
  std::unique_ptr<engine::Head<T>> head;
  if (target) {  // the head's arrays are never read here: stand-ins where the target has none
    static constexpr std::int64_t kStandInClass = 0;
    const T stand_in_value = T(0);
    Target<T> shapes = *target;
    if (!shapes.values) shapes.values = &stand_in_value;
    if (!shapes.classes) shapes.classes = &kStandInClass;
    if (shapes.loss == heads::kPooledCrossEntropy && stack.classes == 0 && !shapes.classifier.weight)
      shapes.classifier.weight = shapes.classifier.bias = &stand_in_value;
    head = heads::make(shapes);
  }
  return engine::WorkingMemory<T>(g, head.get(), wrt, threads).of(call, part, columns);
}

template <class T>
Model<T>::Model(Model&&) noexcept = default;
template <class T>
Model<T>& Model<T>::operator=(Model&&) noexcept = default;
template <class T>
Model<T>::~Model() = default;

template <class T>
void Model<T>::jacobian(int p, T* J) {
  engine::jacobian(*graph_, p, J);
}
template <class T>
void Model<T>::output_hessian(int i, int j, T* out) {
  engine::output_hessian(*graph_, i, j, out);
}
template <class T>
T Model<T>::loss_gradient(const Target<T>& target, T* grad) {
  return engine::reverse_loss(*graph_, *heads::make(target), grad);
}
template <class T>
T Model<T>::loss_hessian(const Target<T>& target, Part part, const Selection& wrt, T* H) {
  return engine::loss_hessian(*graph_, *heads::make(target), part, wrt, H);
}
template <class T>
T Model<T>::loss_hessian_diagonal(const Target<T>& target, Part part, const Selection& wrt, T* diag,
                                    index_t max_products) {
  return engine::loss_hessian_diagonal(*graph_, *heads::make(target), part, wrt, diag, max_products);
}

template <class T>
std::vector<engine::KroneckerFactors<T>> Model<T>::kfac_factors(const Target<T>& target, const Selection& wrt,
                                                                bool reduce) {
  return engine::kfac_factors(*graph_, *heads::make(target), wrt, reduce);
}

template <class T>
LossHessianOperator<T>::LossHessianOperator(Model<T>&& model, const Target<T>& target, Part part, const Selection& wrt)
    : op_(std::make_unique<engine::LossOperator<T>>(std::move(model.graph_), heads::make(target), part, wrt)) {}
template <class T>
LossHessianOperator<T>::LossHessianOperator(LossHessianOperator&&) noexcept = default;
template <class T>
LossHessianOperator<T>& LossHessianOperator<T>::operator=(LossHessianOperator&&) noexcept = default;
template <class T>
LossHessianOperator<T>::~LossHessianOperator() = default;

template <class T>
index_t LossHessianOperator<T>::size() const {
  return op_->size();
}
template <class T>
T LossHessianOperator<T>::loss_value() const {
  return op_->loss_value();
}
template <class T>
void LossHessianOperator<T>::apply(const T* v, T* out) const {
  op_->apply(v, out);
}
template <class T>
void LossHessianOperator<T>::apply_columns(const T* V, index_t k, T* out) const {
  op_->apply_columns(V, k, out);
}

}  // namespace blockhess::block
