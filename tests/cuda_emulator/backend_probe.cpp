// C entry points over the backends' products (blockhess/backend.hpp) for tests/test_backends.py:
// the host backend, and the GPU backend (cuda/src/backend.cu) compiled for the CPU kernel emulator
// with the cuBLAS stand-in (cublas.cpp). Each returns 0, or 1 with the exception's message.
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/blocks/family.hpp"
#include "blockhess/components.hpp"
#include "blockhess/cpu_backend.hpp"
#include "blockhess/cuda/backend.hpp"
#include "blockhess/engine/graph.hpp"
#include "blockhess/heads.hpp"
#include "blockhess/engine/derivatives.hpp"
#include "blockhess/engine/loss.hpp"
#include "blockhess/engine/nodes/attention.hpp"
#include "blockhess/engine/rows.hpp"

namespace {

// 1, with the exception's message in message.
int failed(const std::exception& e, char* message, long message_size) {
  std::strncpy(message, e.what(), static_cast<size_t>(message_size - 1));
  message[message_size - 1] = '\0';
  return 1;
}

template <class T>
blockhess::MatrixView<T> view(T* data, long rows, long cols, long stride, int row_major) {
  return {data, rows, cols, stride, row_major != 0};
}

// The host backend (gpu = 0), or a GPU backend on `stream`, held by `device`.
template <class T>
const blockhess::Backend<T>& backend_for(int gpu, std::unique_ptr<blockhess::cuda::CudaBackend<T>>& device,
                                         std::uintptr_t stream = 0) {
  if (!gpu) return blockhess::cpu_backend<T>();
  device = std::make_unique<blockhess::cuda::CudaBackend<T>>(stream);
  return *device;
}

// call(backend, result) on the host backend (gpu = 0), result `out`; or on the GPU backend, result n
// values of device memory copied back to `out` (host memory).
template <class T, class Call>
void into_host(int gpu, T* out, long n, Call&& call) {
  std::unique_ptr<blockhess::cuda::CudaBackend<T>> device;
  const blockhess::Backend<T>& backend = backend_for(gpu, device);
  if (!gpu) {
    call(backend, out);
    return;
  }
  blockhess::BackendBuffer<T> result(backend, n);
  call(backend, result.data());
  backend.download(out, result.data(), sizeof(T) * static_cast<size_t>(n));
}

template <class T>
int product(int gpu, long count, T* C, long m, long n, long ldc, long c_step, const T* A, long k, long lda,
            int a_row_major, long a_step, const T* B, long ldb, int b_row_major, long b_step, double alpha,
            int accumulate, std::uintptr_t stream, char* message, long message_size) {
  try {
    const auto a = view(A, m, k, lda, a_row_major);
    const auto b = view(B, k, n, ldb, b_row_major);
    const auto c = view(C, m, n, ldc, 1);
    std::unique_ptr<blockhess::cuda::CudaBackend<T>> device;
    const blockhess::Backend<T>& backend = backend_for(gpu, device, stream);
    if (count == 1 && c_step == 0 && a_step == 0 && b_step == 0)
      backend.gemm(c, a, b, static_cast<T>(alpha), accumulate != 0);
    else
      backend.gemm_batched(count, c, c_step, a, a_step, b, b_step, static_cast<T>(alpha), accumulate != 0);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

// op on the host backend (gpu = 0) or the GPU backend on stream 0.
template <class T, class Op>
int run(int gpu, const Op& op, long count, char* message, long message_size) {
  try {
    std::unique_ptr<blockhess::cuda::CudaBackend<T>> device;
    backend_for(gpu, device).run(op, count);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

}  // namespace

namespace rows = blockhess::engine::rows;

// *finite = whether the count values are all finite, by the host backend or the GPU backend.
#define BLOCKHESS_FINITE_PROBE(suffix, T)                                                                  \
  extern "C" __attribute__((visibility("default"))) int all_finite##suffix(int gpu, const T* values, long count, \
                                                                         int* finite) {                     \
    std::unique_ptr<blockhess::cuda::CudaBackend<T>> device;                                                \
    *finite = backend_for(gpu, device).all_finite(values, count);                                           \
    return 0;                                                                                               \
  }
BLOCKHESS_FINITE_PROBE(_f64, double)
BLOCKHESS_FINITE_PROBE(_f32, float)

#define BLOCKHESS_ROW_PROBES(suffix, T)                                                                            \
  extern "C" __attribute__((visibility("default"))) int activation_forward##suffix(                               \
      int gpu, int kind, const T* x, T* y, T* first, T* second, long count, char* message, long message_size) {  \
    return run<T>(gpu, rows::ActivationForward<T>{static_cast<blockhess::activation::Kind>(kind), x, y, first,   \
                                                  second},                                                       \
                  count, message, message_size);                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int scale_entries##suffix(                                    \
      int gpu, const T* scale, const T* x, T* out, int add, long count, char* message, long message_size) {      \
    return run<T>(gpu, rows::ScaleEntries<T>{scale, x, out, add != 0}, count, message, message_size);            \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int activation_cotangent_tangent##suffix(                     \
      int gpu, const T* first, const T* second, const T* dg, const T* g, const T* dx, T* out, int add, long count, \
      char* message, long message_size) {                                                                        \
    return run<T>(gpu, rows::ActivationCotangentTangent<T>{first, second, dg, g, dx, out, add != 0}, count,       \
                  message, message_size);                                                                        \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int zero##suffix(int gpu, T* out, long count, char* message,      \
                                                                     long message_size) {                        \
    return run<T>(gpu, rows::Zero<T>{out}, count, message, message_size);                                        \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int sum_entries##suffix(                                       \
      int gpu, const T* a, const T* b, T* out, long count, char* message, long message_size) {                   \
    return run<T>(gpu, rows::SumEntries<T>{a, b, out}, count, message, message_size);                            \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int write_entries##suffix(                                     \
      int gpu, const T* x, T* out, int add, long count, char* message, long message_size) {                      \
    return run<T>(gpu, rows::WriteEntries<T>{x, out, add != 0}, count, message, message_size);                   \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int add_bias##suffix(                                          \
      int gpu, const T* bias, T* out, long width, long count, char* message, long message_size) {                \
    return run<T>(gpu, rows::AddBias<T>{bias, out, width}, count, message, message_size);                        \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int softmax_rows##suffix(                                      \
      int gpu, T* a, long L, int causal, long count, char* message, long message_size) {                         \
    return run<T>(gpu, rows::SoftmaxRows<T>{a, L, causal != 0}, count, message, message_size);                   \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int softmax_vjp_rows##suffix(                                  \
      int gpu, const T* a, const T* g, T* gt, long L, long count, char* message, long message_size) {            \
    return run<T>(gpu, rows::SoftmaxVjpRows<T>{a, g, gt, L}, count, message, message_size);                       \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int normalize_rows##suffix(                                    \
      int gpu, const T* u, T* n, T* scale, long d, double eps, int rms, long count, char* message,                 \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::NormalizeRows<T>{u, n, scale, d, static_cast<T>(eps), rms != 0}, count, message,     \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int scale_columns##suffix(                                     \
      int gpu, const T* n, const T* gamma, T* y, long d, long count, char* message, long message_size) {         \
    return run<T>(gpu, rows::ScaleColumns<T>{n, gamma, y, d}, count, message, message_size);                     \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int norm_tangent_rows##suffix(                                 \
      int gpu, const T* n, const T* scale, const T* du, const T* gamma, const T* dgamma, const T* dbeta, T* dn,   \
      T* dy, long d, int rms, long count, char* message, long message_size) {                                     \
    return run<T>(gpu, rows::NormTangentRows<T>{n, scale, du, gamma, dgamma, dbeta, dn, dy, d, rms != 0}, count,   \
                  message, message_size);                                                                        \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int norm_vjp_rows##suffix(                                     \
      int gpu, const T* n, const T* scale, const T* gy, const T* gamma, T* out, int add, long d, int rms, long count, \
      char* message, long message_size) {                                                                        \
    return run<T>(gpu, rows::NormVjpRows<T>{n, scale, gy, gamma, out, add != 0, d, rms != 0}, count, message,     \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int norm_cotangent_tangent_rows##suffix(                       \
      int gpu, const T* n, const T* scale, const T* gy, const T* dgy, const T* gamma, const T* dgamma, const T* du, \
      const T* dn, T* out, int add, int curved, long d, int rms, long count, char* message, long message_size) {  \
    return run<T>(gpu,                                                                                           \
                  rows::NormCotangentTangentRows<T>{n, scale, gy, dgy, gamma, dgamma, du, dn, out, add != 0,       \
                                                    curved != 0, d, rms != 0},                                   \
                  count, message, message_size);                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int column_sums##suffix(                                       \
      int gpu, const T* a, const T* b, T* out, long rows, long cols, int accumulate, long count, char* message,    \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::ColumnSums<T>{a, b, out, rows, cols, accumulate != 0}, count, message, message_size); \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int scale_by##suffix(                                          \
      int gpu, double alpha, const T* x, T* out, long count, char* message, long message_size) {                 \
    return run<T>(gpu, rows::ScaleBy<T>{static_cast<T>(alpha), x, out}, count, message, message_size);           \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int cross_entropy_tangent_rows##suffix(                        \
      int gpu, const T* p, const T* dz, T* out, long d, double scale, long count, char* message,                  \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::CrossEntropyTangentRows<T>{p, dz, out, d, static_cast<T>(scale)}, count, message,    \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int class_token_rows##suffix(                                  \
      int gpu, const T* token, const T* x, T* out, int add, long period, long d, long count, char* message,       \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::ClassTokenRows<T>{token, x, out, add != 0, period, d}, count, message, message_size); \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int gather_rows##suffix(                                       \
      int gpu, const T* table, const std::int64_t* ids, T* out, long width, long count, char* message,           \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::GatherRows<T>{table, ids, out, width}, count, message, message_size);               \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int scatter_rows##suffix(                                      \
      int gpu, const T* rows_in, const std::int64_t* used, const std::int64_t* starts, const std::int64_t* order, \
      T* table, long width, long count, char* message, long message_size) {                                      \
    return run<T>(gpu, rows::ScatterRows<T>{rows_in, used, starts, order, table, width, 1}, count, message,       \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int sample_sums##suffix(                                       \
      int gpu, const T* x, T* out, long L, long width, long count, char* message, long message_size) {           \
    return run<T>(gpu, rows::SampleSums<T>{x, out, L, width}, count, message, message_size);                     \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int pooled_cross_entropy_rows##suffix(                         \
      int gpu, const T* z, const std::int64_t* classes, const T* weight, const T* bias, T* p, T* wp, T* gz,      \
      T* row_loss, long L, long d, long C, double inv_B, double inv_L, long count, char* message,                \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::PooledCrossEntropyRows<T>{z, classes, weight, bias, p, wp, gz, row_loss, L, d, C,    \
                                                       static_cast<T>(inv_B), static_cast<T>(inv_L)},           \
                  count, message, message_size);                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int pooled_block_entries##suffix(                              \
      int gpu, const T* p, const T* wp, const T* weight, T* G, long d, long C, double scale, long count,          \
      char* message, long message_size) {                                                                        \
    return run<T>(gpu, rows::PooledBlockEntries<T>{p, wp, weight, G, d, C, static_cast<T>(scale)}, count, message, \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int pooled_block_apply##suffix(                                \
      int gpu, const T* G, const T* sums, T* out, long L, long d, long count, char* message, long message_size) { \
    return run<T>(gpu, rows::PooledBlockApply<T>{G, sums, out, L, d}, count, message, message_size);             \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int mse_rows##suffix(                                          \
      int gpu, const T* z, const T* target, T* gz, T* row_loss, long d, double scale, long count, char* message,   \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::MseRows<T>{z, target, gz, row_loss, d, static_cast<T>(scale)}, count, message,        \
                  message_size);                                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int cross_entropy_rows##suffix(                                \
      int gpu, const T* z, const std::int64_t* classes, T* p, T* gz, T* row_loss, long d, double scale, int ignoring, \
      long count, char* message, long message_size) {                                                            \
    return run<T>(gpu, rows::CrossEntropyRows<T>{z, classes, p, gz, row_loss, d, static_cast<T>(scale), ignoring != 0, \
                                                 blockhess::engine::kIgnoredClass},                              \
                  count, message, message_size);                                                                 \
  }                                                                                                              \
  extern "C" __attribute__((visibility("default"))) int softmax_cotangent_tangent_rows##suffix(                    \
      int gpu, const T* a, const T* da, const T* g, const T* dg, T* dgt, long L, long count, char* message,        \
      long message_size) {                                                                                       \
    return run<T>(gpu, rows::SoftmaxCotangentTangentRows<T>{a, da, g, dg, dgt, L}, count, message, message_size);  \
  }
BLOCKHESS_ROW_PROBES(_f64, double)
BLOCKHESS_ROW_PROBES(_f32, float)

#define BLOCKHESS_PROBE(name, T)                                                                                    \
  extern "C" __attribute__((visibility("default"))) int name(                                                     \
      int gpu, long count, T* C, long m, long n, long ldc, long c_step, const T* A, long k, long lda,             \
      int a_row_major, long a_step, const T* B, long ldb, int b_row_major, long b_step, double alpha,             \
      int accumulate, std::uintptr_t stream, char* message, long message_size) {                                  \
    return product<T>(gpu, count, C, m, n, ldc, c_step, A, k, lda, a_row_major, a_step, B, ldb, b_row_major,      \
                      b_step, alpha, accumulate, stream, message, message_size);                                  \
  }
BLOCKHESS_PROBE(product_f64, double)
BLOCKHESS_PROBE(product_f32, float)

// ---- the engine on a backend ----------------------------------------------------------------------

namespace {

// A block of the family or a model of them on the host backend (gpu = 0) or the GPU backend
// (gpu = 1), at X or (a language model) the token ids, in the host's memory: the loss (its code,
// heads.hpp's: mse against target, a cross-entropy against classes) into *value, its gradient into
// grad and, for the Hessian's part (0 full, 1 outer, 2 functional) over every parameter, H v into
// hv. spec: the 17 codes of spec.py's BlockSpec._core() (model.py's ModelSpec's); weights: one per
// parameter, in the core's order.
// A block of the family and its stack from spec, the 17 codes of spec.py's BlockSpec._core()
// (model.py's ModelSpec's).
blockhess::block::Spec spec_of(const long* spec) {
  namespace block = blockhess::block;
  block::Spec s;
  s.norm_position = static_cast<block::NormPosition>(spec[0]);
  s.norm = static_cast<block::Norm>(spec[1]);
  s.norm_affine = spec[2] != 0, s.bias = spec[3] != 0, s.heads = spec[4], s.out_proj = spec[5] != 0;
  s.activation = blockhess::activation::from_code(static_cast<int>(spec[6]));
  s.causal = spec[7] != 0, s.attention_only = spec[8] != 0;
  return s;
}
blockhess::block::Stack stack_of(const long* spec) {
  return {spec[9], spec[10] != 0, spec[11], spec[12], spec[13] != 0, spec[14], spec[15], spec[16] != 0};
}

// The graph of that block or model at X or (a language model) the token ids, in the host's
// memory, on `backend`, after its forward pass; weights: one per parameter, in the core's order.
template <class T>
std::unique_ptr<blockhess::engine::Graph<T>> wired(const blockhess::Backend<T>& backend, const long* spec, long B, long L,
                                                   long d, long dk, long dv, long dff, double eps, const T* X,
                                                   const std::int64_t* ids, const T* const* weights, long n_weights) {
  auto g = std::make_unique<blockhess::engine::Graph<T>>(B, L, backend);
  blockhess::blocks::wire_stack(*g, spec_of(spec), blockhess::block::Dims{L, d, dk, dff, dv}, stack_of(spec),
                                blockhess::blocks::Input<T>{X, ids}, std::vector<const T*>(weights, weights + n_weights),
                                static_cast<T>(eps));
  g->forward();
  return g;
}

template <class T>
int block_loss_hvp(int gpu, const long* spec, long B, long L, long d, long dk, long dv, long dff, double eps,
                   const T* X, const std::int64_t* ids, const T* const* weights, long n_weights, int loss,
                   const T* target, const std::int64_t* classes, int part, const T* v, T* value, T* grad, T* hv,
                   char* message, long message_size) {
  namespace engine = blockhess::engine;
  try {
    std::unique_ptr<blockhess::cuda::CudaBackend<T>> device;
    const blockhess::Backend<T>& backend = backend_for(gpu, device);
    const auto graph = wired(backend, spec, B, L, d, dk, dv, dff, eps, X, ids, weights, n_weights);
    engine::Graph<T>& g = *graph;
    const blockhess::block::Stack stack = stack_of(spec);
    blockhess::heads::Target<T> t;
    t.loss = loss;
    t.values = target;
    t.classes = classes;
    t.classifier.classes = stack.classes;  // a model's own classifier (its output is the logits)
    t.classifier.first_token = stack.class_token;
    const std::unique_ptr<engine::Head<T>> head = blockhess::heads::make(t);
    *value = engine::reverse_loss(g, *head, grad);
    const std::vector<bool> every(static_cast<size_t>(g.num_params()), true);
    engine::selected_products(g, *head, static_cast<engine::Part>(part), every).apply(v, hv);
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

}  // namespace

#define BLOCKHESS_ENGINE_PROBE(suffix, T)                                                                          \
  extern "C" __attribute__((visibility("default"))) int block_loss_hvp##suffix(                                    \
      int gpu, const long* spec, long B, long L, long d, long dk, long dv, long dff, double eps, const T* X,        \
      const std::int64_t* ids, const T* const* weights, long n_weights, int loss, const T* target,                 \
      const std::int64_t* classes, int part, const T* v, T* value, T* grad, T* hv, char* message,                  \
      long message_size) {                                                                                         \
    return block_loss_hvp<T>(gpu, spec, B, L, d, dk, dv, dff, eps, X, ids, weights, n_weights, loss, target,      \
                             classes, part, v, value, grad, hv, message, message_size);                           \
  }
BLOCKHESS_ENGINE_PROBE(_f64, double)
BLOCKHESS_ENGINE_PROBE(_f32, float)

namespace {

// dZ/dW_p of that block or model (one sample: X, or a language model's token ids), (L width(Z),
// n_p), into J (host memory; on the GPU written in device memory and copied back): its factors
// pushed on the backend.
template <class T>
int block_jacobian(int gpu, const long* spec, long L, long d, long dk, long dv, long dff, double eps, const T* X,
                   const std::int64_t* ids, const T* const* weights, long n_weights, int p, T* J, long n,
                   char* message, long message_size) {
  try {
    into_host(gpu, J, n, [&](const blockhess::Backend<T>& backend, T* result) {
      const auto g = wired(backend, spec, 1, L, d, dk, dv, dff, eps, X, ids, weights, n_weights);
      blockhess::FiniteRecord finite;
      blockhess::engine::jacobian(*g, p, result, &finite);
      finite.require<T>("the block Jacobian");
    });
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

}  // namespace

#define BLOCKHESS_JACOBIAN_PROBE(suffix, T)                                                                        \
  extern "C" __attribute__((visibility("default"))) int block_jacobian##suffix(                                    \
      int gpu, const long* spec, long L, long d, long dk, long dv, long dff, double eps, const T* X,               \
      const std::int64_t* ids, const T* const* weights, long n_weights, int p, T* J, long n, char* message,        \
      long message_size) {                                                                                         \
    return block_jacobian<T>(gpu, spec, L, d, dk, dv, dff, eps, X, ids, weights, n_weights, p, J, n, message,     \
                             message_size);                                                                        \
  }
BLOCKHESS_JACOBIAN_PROBE(_f64, double)
BLOCKHESS_JACOBIAN_PROBE(_f32, float)

// 1 with the message where a part of the engine that still runs on the host (the nodes' curvature
// terms) refuses a graph on the GPU backend, 0 where it does not. The factors before it, a norm's
// gamma mixed by an attention, run there.
extern "C" __attribute__((visibility("default"))) int gpu_graph_refuses_curvature(char* message, long message_size) {
  namespace engine = blockhess::engine;
  const blockhess::cuda::CudaBackend<double> gpu(0);
  engine::Graph<double> graph(1, 2, gpu);
  const double X[6] = {0.3, -1.2, 0.5, 1.1, 0.2, -0.7}, gamma[3] = {1.0, 0.9, 1.2};
  const double W[6] = {0.4, -0.3, 0.2, 0.5, -0.6, 0.1};
  const int x = graph.input(X, 3);
  const int normed = graph.add(std::make_unique<engine::LayerNormNode<double>>(1e-5), {x},
                               {graph.param("gamma", 1, 3, gamma)}, 3);
  std::vector<int> weights;
  for (const char* name : {"W_Q", "W_K", "W_V"}) weights.push_back(graph.param(name, 3, 2, W));
  graph.set_output(graph.add(std::make_unique<engine::AttentionNode<double>>(), {normed}, weights, 2));
  graph.forward();
  graph.select({true, false, false, false});  // gamma, whose factors the attention mixes
  try {
    graph.push_factors(/*to_output=*/true);
    graph.curvature();
    return 0;
  } catch (const std::invalid_argument& e) {
    return failed(e, message, message_size);
  }
}

namespace {

// The sublayers (components.hpp) on the host backend (gpu = 0) or the GPU backend (gpu = 1), their
// inputs in the host's memory, into out (n values, host memory; on the GPU written in device memory
// and copied back). The FFN relu(Y W_1) W_2: what = 0 its output, 1 its Jacobian or Kronecker factor
// of `kind`, 2 its cross second derivative of `kind`. The attention: what = 0 its output, 1 its
// Jacobian with respect to `kind` (components::AttentionWrt).
template <class T>
int ffn_component(int gpu, long L, long d, long f, long e, const T* Y, const T* W1, const T* W2, int what, int kind,
                  T* out, long n, char* message, long message_size) {
  namespace components = blockhess::components;
  try {
    const components::FfnDims s{L, d, f, e};
    into_host(gpu, out, n, [&](const blockhess::Backend<T>& backend, T* result) {
      if (what == 0) components::ffn_forward(Y, W1, W2, s, result, backend);
      else if (what == 1) components::ffn_jacobian(Y, W1, W2, s, static_cast<components::FfnJacobian>(kind), result, backend);
      else components::ffn_cross_hessian(Y, W1, W2, s, static_cast<components::FfnCross>(kind), result, backend);
    });
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

template <class T>
int attention_component(int gpu, long L, long d, long dk, long dv, const T* X, const T* WQ, const T* WK, const T* WV,
                        int what, int kind, T* out, long n, char* message, long message_size) {
  namespace components = blockhess::components;
  try {
    const components::AttentionDims s{L, d, dk, dv};
    into_host(gpu, out, n, [&](const blockhess::Backend<T>& backend, T* result) {
      if (what == 0) components::attention_forward(X, WQ, WK, WV, s, result, backend);
      else components::attention_jacobian(X, WQ, WK, WV, s, static_cast<components::AttentionWrt>(kind), result, backend);
    });
    return 0;
  } catch (const std::exception& e) {
    return failed(e, message, message_size);
  }
}

}  // namespace

#define BLOCKHESS_COMPONENT_PROBES(suffix, T)                                                                       \
  extern "C" __attribute__((visibility("default"))) int ffn_component##suffix(                                     \
      int gpu, long L, long d, long f, long e, const T* Y, const T* W1, const T* W2, int what, int kind, T* out,   \
      long n, char* message, long message_size) {                                                                  \
    return ffn_component<T>(gpu, L, d, f, e, Y, W1, W2, what, kind, out, n, message, message_size);               \
  }                                                                                                                \
  extern "C" __attribute__((visibility("default"))) int attention_component##suffix(                               \
      int gpu, long L, long d, long dk, long dv, const T* X, const T* WQ, const T* WK, const T* WV, int what,      \
      int kind, T* out, long n, char* message, long message_size) {                                                \
    return attention_component<T>(gpu, L, d, dk, dv, X, WQ, WK, WV, what, kind, out, n, message, message_size);   \
  }
BLOCKHESS_COMPONENT_PROBES(_f64, double)
BLOCKHESS_COMPONENT_PROBES(_f32, float)

// Writes one value of the GPU backend's memory from the host: on the emulator this must fault
// (its device memory is closed to the host outside device work), or the engine tests above could
// not catch a node that touches device memory on the host.
extern "C" __attribute__((visibility("default"))) void host_writes_gpu_memory() {
  const blockhess::cuda::CudaBackend<double> gpu(0);
  double* p = gpu.allocate(1);
  *static_cast<volatile double*>(p) = 1.0;
  gpu.release(p, 1);
}
