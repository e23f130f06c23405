// The core's one GEMM (parallel_product.hpp) compiled for both scalars, once per instruction-set
// level of the Python modules: the code that most profits from wider vector units.
#include "blockhess/parallel_product_impl.hpp"

template void blockhess::matrix_product<float>(blockhess::MatrixView<float>, blockhess::MatrixView<const float>,
                                               blockhess::MatrixView<const float>, float, bool);
template void blockhess::matrix_product<double>(blockhess::MatrixView<double>, blockhess::MatrixView<const double>,
                                                blockhess::MatrixView<const double>, double, bool);
