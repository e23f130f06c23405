// The definitions behind block_model.hpp: each member forwards to the engine's block functions
// (block.hpp, block_hessian.hpp, block_loss.hpp, block_hvp.hpp).
#pragma once

#include <utility>

#include "blockhess/block.hpp"
#include "blockhess/block_hessian.hpp"
#include "blockhess/block_hvp.hpp"
#include "blockhess/block_loss.hpp"
#include "blockhess/block_model.hpp"

namespace blockhess::block {

template <class T>
Model<T>::Model(const Spec& spec, const Dims& dims, index_t samples, const T* X, const std::vector<const T*>& weights,
                T eps, engine::Storage storage)
    : e_(std::make_unique<Evaluation<T>>(spec, dims, samples, X, weights, eps, storage)) {}
template <class T>
Model<T>::Model(Model&&) noexcept = default;
template <class T>
Model<T>& Model<T>::operator=(Model&&) noexcept = default;
template <class T>
Model<T>::~Model() = default;

template <class T>
const std::vector<ParamShape>& Model<T>::shapes() const {
  return e_->shapes();
}
template <class T>
index_t Model<T>::samples() const {
  return e_->samples();
}
template <class T>
index_t Model<T>::tokens() const {
  return e_->tokens();
}
template <class T>
const T* Model<T>::output() const {
  return e_->output();
}
template <class T>
void Model<T>::jacobian(int p, T* J) {
  block::jacobian(*e_, p, J);
}
template <class T>
void Model<T>::output_hessian(int i, int j, T* out) {
  block::output_hessian(*e_, i, j, out);
}
template <class T>
T Model<T>::loss_gradient(const Target<T>& target, T* grad) {
  return block::loss_gradient(*e_, target, grad);
}
template <class T>
T Model<T>::loss_hessian(const Target<T>& target, Part part, const Selection& wrt, T* H) {
  return block::loss_hessian(*e_, target, part, wrt, H);
}
template <class T>
T Model<T>::loss_hessian_diagonal(const Target<T>& target, Part part, const Selection& wrt, T* diag) {
  return block::loss_hessian_diagonal(*e_, target, part, wrt, diag);
}
template <class T>
Evaluation<T>& Model<T>::evaluation() {
  return *e_;
}

template <class T>
LossHessianOperator<T>::LossHessianOperator(Model<T>&& model, const Target<T>& target, Part part, const Selection& wrt)
    : op_(std::make_unique<HessianOperator<T>>(std::move(*model.e_), target, part, wrt)) {}
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
