// The dense Hessian's assembly and its diagonal (engine/assemble.hpp, engine/diagonal.hpp) into host
// memory, for both scalars, once per instruction-set level of the Python modules: the per-token
// products that form every block (the Gammas of kron_sum.hpp) profit from wider vector units.
#include "blockhess/engine/assemble.hpp"
#include "blockhess/engine/diagonal.hpp"

namespace blockhess::engine {
template void assemble<float, HostHessian<float>>(const Graph<float>&, Terms<float>, const std::vector<index_t>&,
                                                  HostHessian<float>&);
template void assemble<double, HostHessian<double>>(const Graph<double>&, Terms<double>, const std::vector<index_t>&,
                                                    HostHessian<double>&);
template void add_diagonal<float>(const Graph<float>&, Terms<float>, const std::vector<index_t>&, float*);
template void add_diagonal<double>(const Graph<double>&, Terms<double>, const std::vector<index_t>&, double*);
}  // namespace blockhess::engine
