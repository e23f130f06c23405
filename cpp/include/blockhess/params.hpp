// The block family and its parameter registry: the one place that says which parameters a block
// has, what they are called, their shapes and their order (the order of a flattened parameter
// vector and of the rows and columns of a dense Hessian). Python's BlockSpec and BlockParams read
// it through _core.block_parameters.
#pragma once

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

#include "blockhess/activation.hpp"
#include "blockhess/config.hpp"

namespace blockhess::block {

// Which block (the paper's is the default): where the norms sit, whether they have trainable
// gamma (and beta), biases on every linear map, the number of heads, an output projection W_O,
// the FFN's activation and a causal mask. attention_only: the self-attention sublayer alone
// (Z = attn(X), the paper's Thm 1 setting: no residual, no norms, no FFN).
// The registries of where the norms sit and which norm (a name's code is its index; Python reads
// them: BlockSpec, the command lines). Each selects a wiring (blocks/family.hpp) or a node
// (blocks/sublayers.hpp).
enum class NormPosition : int { post = 0, pre = 1 };
inline constexpr std::array<const char*, 2> kNormPositions{"post", "pre"};
enum class Norm : int { layernorm = 0, rmsnorm = 1 };
inline constexpr std::array<const char*, 2> kNorms{"layernorm", "rmsnorm"};

struct Spec {
  NormPosition norm_position = NormPosition::post;
  Norm norm = Norm::layernorm;
  bool norm_affine = false;
  bool bias = false;
  index_t heads = 1;
  bool out_proj = false;
  activation::Kind activation = activation::Kind::relu;
  bool causal = false;
  bool attention_only = false;
};

// The sizes of a block: L tokens of width d, d_k query/key and d_v value columns per head, d_ff
// hidden units.
struct Dims {
  index_t L = 0, d = 0, dk = 0, dff = 0, dv = 0;  // dv = 0: d / heads (the paper: d)

  index_t value_width(const Spec& s) const { return dv > 0 ? dv : d / s.heads; }
  // has_ffn = false (an attention-only block): d_ff is not used and may be 0.
  void check(bool has_ffn = true) const {
    if (L < 1 || d < 1 || dk < 1 || (has_ffn && dff < 1))
      throw std::invalid_argument(has_ffn ? "block: L, d, d_k and d_ff must all be >= 1"
                                          : "block: L, d and d_k must all be >= 1");
  }
};

struct ParamShape {
  std::string name;
  index_t rows = 0, cols = 0;
  bool vector = false;  // a bias, gamma or beta: shape (cols,) to the caller, (1, cols) inside
  index_t size() const { return rows * cols; }
};

inline void check(const Spec& s, const Dims& D) {
  D.check(!s.attention_only);
  if (s.attention_only && (s.norm_position != NormPosition::post || s.norm != Norm::layernorm || s.norm_affine ||
                           s.activation != activation::Kind::relu))
    throw std::invalid_argument("block: attention_only has no norms and no FFN: norm_position, norm, norm_affine and "
                                "activation must keep their defaults");
  if (s.heads < 1) throw std::invalid_argument("block: heads must be >= 1");
  if (D.value_width(s) < 1) throw std::invalid_argument("block: d_v must be >= 1");
  if (!s.out_proj && s.heads * D.value_width(s) != D.d)
    throw std::invalid_argument("block: without out_proj, heads * d_v must equal d");
}

// A norm's parameters, when the spec's norms have them: gamma (d), and beta (d) for a LayerNorm.
inline void norm_parameters(const Spec& s, index_t d, const std::string& gamma, const std::string& beta,
                            std::vector<ParamShape>& out) {
  if (!s.norm_affine) return;
  out.push_back({gamma, 1, d, true});
  if (s.norm != Norm::rmsnorm) out.push_back({beta, 1, d, true});
}

// The parameters of a block, in the canonical order: W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O,
// gamma_1, beta_1, W_1, b_1, W_2, b_2, gamma_2, beta_2 (each only where the spec has it; an
// attention-only block stops after b_O).
inline std::vector<ParamShape> parameters(const Spec& s, const Dims& D) {
  const index_t d = D.d, hk = s.heads * D.dk, hv = s.heads * D.value_width(s), dff = D.dff;
  std::vector<ParamShape> out;
  auto matrix = [&](const char* name, index_t rows, index_t cols) { out.push_back({name, rows, cols, false}); };
  auto vector = [&](const char* name, index_t n) { out.push_back({name, 1, n, true}); };
  matrix("W_Q", d, hk);
  if (s.bias) vector("b_Q", hk);
  matrix("W_K", d, hk);
  if (s.bias) vector("b_K", hk);
  matrix("W_V", d, hv);
  if (s.bias) vector("b_V", hv);
  if (s.out_proj) {
    matrix("W_O", hv, d);
    if (s.bias) vector("b_O", d);
  }
  if (s.attention_only) return out;
  norm_parameters(s, d, "gamma_1", "beta_1", out);
  matrix("W_1", d, dff);
  if (s.bias) vector("b_1", dff);
  matrix("W_2", dff, d);
  if (s.bias) vector("b_2", d);
  norm_parameters(s, d, "gamma_2", "beta_2", out);
  return out;
}

// The name prefix of layer l of a stack of `layers` blocks: "h.<l>.", or none for a lone block (its
// names do not change).
inline std::string layer_prefix(index_t layers, index_t l) {
  return layers == 1 ? std::string() : "h." + std::to_string(l) + ".";
}

// A model: `layers` blocks of a spec, each on the previous one's output, then (final_norm) a norm of
// the spec's kind, with its own parameters ln_f.gamma (and ln_f.beta) where the spec's norms have
// them (GPT-2's ln_f, nn.TransformerEncoder's norm). Its input is one of
//   X (samples x L x d), the blocks' own;
//   token ids (vocab > 0, a language model): their rows of the embedding wte (vocab, d);
//   image patches (patch_dim > 0, a ViT): X (samples x L x patch_dim) W_E + b_E, W_E (patch_dim, d),
//     with class_token the first token of every sample the learned cls_token instead (its row of X a
//     placeholder);
// then, with `positions` > 0, the learned positions wpe (positions, d), row i at position i. Its
// output is the last block's (or ln_f's), or with lm_head the logits Z wte^T (the LM head tied to
// the embedding, as GPT-2's: one parameter, used twice), or with `classes` > 0 a classifier's
// per-token logits Z W_C + b_C, W_C (d, classes), which pooled_cross_entropy averages per sample (or
// takes at the class token).
struct Stack {
  index_t layers = 1;
  bool final_norm = false;
  index_t vocab = 0;
  index_t positions = 0;
  bool lm_head = false;
  index_t patch_dim = 0;
  index_t classes = 0;
  bool class_token = false;

  bool reads_tokens() const { return vocab > 0; }
  bool reads_patches() const { return patch_dim > 0; }
  // The width of the model's output, for blocks of width d.
  index_t output_width(index_t d) const { return lm_head ? vocab : classes > 0 ? classes : d; }
  void check(const Spec& s) const {
    if (layers < 1) throw std::invalid_argument("block: layers must be >= 1");
    if (final_norm && s.attention_only)
      throw std::invalid_argument("block: attention_only has no norms, so a stack of it has no final norm");
    if (vocab < 0 || positions < 0 || patch_dim < 0 || classes < 0)
      throw std::invalid_argument("model: vocab, positions, patch_dim and classes must be >= 0");
    if (!reads_tokens() && lm_head) throw std::invalid_argument("model: an LM head needs a token embedding (vocab > 0)");
    if (reads_tokens() && reads_patches()) throw std::invalid_argument("model: token ids or image patches, not both");
    if (lm_head && classes > 0) throw std::invalid_argument("model: an LM head or a classifier, not both");
    if (class_token && !reads_patches()) throw std::invalid_argument("model: a class token needs a patch embedding");
  }
};

// The parameters of a model: its input's (wte, or W_E, b_E and cls_token; then wpe), each layer's, prefixed,
// layer after layer; then the final norm's and the classifier's (W_C, b_C). The tied LM head has
// none of its own.
inline std::vector<ParamShape> parameters(const Spec& s, const Dims& D, const Stack& stack) {
  stack.check(s);
  std::vector<ParamShape> out;
  if (stack.reads_tokens()) out.push_back({"wte", stack.vocab, D.d, false});
  if (stack.reads_patches()) {
    out.push_back({"W_E", stack.patch_dim, D.d, false});
    out.push_back({"b_E", 1, D.d, true});
    if (stack.class_token) out.push_back({"cls_token", 1, D.d, true});
  }
  if (stack.positions > 0) out.push_back({"wpe", stack.positions, D.d, false});
  for (index_t l = 0; l < stack.layers; ++l)
    for (ParamShape p : parameters(s, D)) {
      p.name = layer_prefix(stack.layers, l) + p.name;
      out.push_back(std::move(p));
    }
  if (stack.final_norm) norm_parameters(s, D.d, "ln_f.gamma", "ln_f.beta", out);
  if (stack.classes > 0) {
    out.push_back({"W_C", D.d, stack.classes, false});
    out.push_back({"b_C", 1, stack.classes, true});
  }
  return out;
}

// The parameters chosen for a derivative (wrt): one flag per parameter.
using Selection = std::vector<bool>;

}  // namespace blockhess::block
