// The block's C++ API (block_model.hpp) compiled for double, once per instruction-set level of the
// Python modules (the top-level CMakeLists.txt); the bindings, built with BLOCKHESS_COMPILED, link to it.
#include "blockhess/block_model_impl.hpp"

template class blockhess::block::Model<double>;
template class blockhess::block::LossHessianOperator<double>;
