// The assembly's sums of Kronecker products (kron_sum.hpp) for both scalars, once per
// instruction-set level of the Python modules: with the GEMM, the code that profits from wider
// vector units when the Hessian is formed.
#include "blockhess/kron_sum_impl.hpp"

namespace blockhess::kron {
template void accumulate<float>(index_t, const Split&, const float*, const Split&, const float*,
                                const std::function<void(index_t, float*)>&, float, float*, index_t, bool, bool, bool);
template void accumulate<double>(index_t, const Split&, const double*, const Split&, const double*,
                                 const std::function<void(index_t, double*)>&, double, double*, index_t, bool, bool,
                                 bool);
template void accumulate_diagonal<float>(index_t, const Split&, const float*, const Split&, const float*, const float*,
                                         float, float*, index_t, bool);
template void accumulate_diagonal<double>(index_t, const Split&, const double*, const Split&, const double*,
                                          const double*, double, double*, index_t, bool);
template bool mirror_upper<float>(float*, index_t);
template bool mirror_upper<double>(double*, index_t);
}  // namespace blockhess::kron
