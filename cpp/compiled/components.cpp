// The component functions (components.hpp) for both scalars, compiled once: the bindings, built
// with BLOCKHESS_COMPILED, link to these.
#include "blockhess/components_impl.hpp"

namespace blockhess::components {
#define BLOCKHESS_COMPONENTS(T)                                                                               \
  template void attention_forward<T>(const T*, const T*, const T*, const T*, const AttentionDims&, T*,         \
                                     const Backend<T>&);                                                      \
  template void attention_jacobian<T>(const T*, const T*, const T*, const T*, const AttentionDims&,           \
                                      AttentionWrt, T*, const Backend<T>&);                                   \
  template void ffn_forward<T>(const T*, const T*, const T*, const FfnDims&, T*, const Backend<T>&);          \
  template void ffn_jacobian<T>(const T*, const T*, const T*, const FfnDims&, FfnJacobian, T*,                \
                                const Backend<T>&);                                                           \
  template void ffn_cross_hessian<T>(const T*, const T*, const T*, const FfnDims&, FfnCross, T*,              \
                                     const Backend<T>&);                                                      \
  template index_t attention_working_memory<T>(const AttentionDims&, std::optional<AttentionWrt>, index_t);   \
  template index_t ffn_working_memory<T>(const FfnDims&, std::optional<FfnJacobian>, index_t);                \
  template index_t ffn_cross_working_memory<T>(const FfnDims&, FfnCross, index_t);
BLOCKHESS_COMPONENTS(float)
BLOCKHESS_COMPONENTS(double)
#undef BLOCKHESS_COMPONENTS
}  // namespace blockhess::components
