"""Import a block from PyTorch: ``spec, params = blockhess.from_torch(module)``.

Supported: ``torch.nn.TransformerEncoderLayer`` (any ``nhead``, ``norm_first`` either way,
activation relu or gelu, ``batch_first`` either way) and Hugging Face ``transformers``' ``GPT2Block``
(pre-LN, causal, gelu_tanh, Conv1D weights). The parameters are copied (float64 or float32, as the
module holds them) into blockhess's canonical order; anything the family cannot represent is a
ValueError that names it, never a silently different block.

Layouts: torch's ``nn.Linear`` computes ``x W^T + b`` (weights stored (out, in)), blockhess ``x W + b``
(W stored (in, out)); ``Conv1D`` of GPT-2 already stores (in, out). ``TransformerEncoderLayer`` with
``batch_first=False`` takes (L, B, d); blockhess takes (B, L, d) (or (L, d) for one sample).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .block import BlockParams
from .spec import BlockSpec


def from_torch(module: Any) -> tuple[BlockSpec, BlockParams]:
    """(spec, params) of a ``torch.nn.TransformerEncoderLayer`` or a ``transformers`` ``GPT2Block``."""
    import torch

    if isinstance(module, torch.nn.TransformerEncoderLayer):
        return _encoder_layer(module)
    if type(module).__name__ == "GPT2Block":
        return _gpt2_block(module)
    raise TypeError(f"from_torch takes a torch.nn.TransformerEncoderLayer or a transformers GPT2Block, "
                    f"got {type(module).__name__}")


def _array(t: Any) -> np.ndarray:
    a = t.detach().cpu().numpy()
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"from_torch: parameters must be float32 or float64, got {a.dtype}")
    return np.array(a)  # a copy: blockhess never shares memory with the module


def _norm_eps(*norms: Any) -> float:
    eps = {float(n.eps) for n in norms}
    if len(eps) != 1:
        raise ValueError(f"from_torch: both LayerNorms must share one eps, got {sorted(eps)}")
    for n in norms:
        if not n.elementwise_affine:
            raise ValueError("from_torch: a LayerNorm without elementwise_affine is not supported (the family's "
                             "norms are all affine or all plain)")
        if n.bias is None:
            raise ValueError("from_torch: a LayerNorm without bias (beta) is not representable yet: the family's "
                             "affine LayerNorm has both gamma and beta")
    return eps.pop()


def _encoder_layer(layer: Any) -> tuple[BlockSpec, BlockParams]:
    import torch.nn.functional as F

    attention = layer.self_attn
    if not attention._qkv_same_embed_dim or attention.in_proj_weight is None:
        raise ValueError("from_torch: self-attention with separate key/value widths (kdim, vdim) is not supported")
    if attention.bias_k is not None or attention.add_zero_attn:
        raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
    dropouts = [layer.dropout.p, layer.dropout1.p, layer.dropout2.p, attention.dropout]
    if layer.training and any(p > 0 for p in dropouts):
        warnings.warn("from_torch: the layer is in training mode with dropout; blockhess's block has no dropout "
                      "(it equals the layer in eval mode)", stacklevel=3)
    activation = getattr(layer, "activation_relu_or_gelu", 0)
    if activation == 1 or layer.activation is F.relu:
        name = "relu"
    elif activation == 2 or layer.activation is F.gelu:
        name = "gelu"
    else:
        raise ValueError(f"from_torch: activation {layer.activation!r} is not supported (relu or gelu)")
    eps = _norm_eps(layer.norm1, layer.norm2)
    bias = attention.in_proj_bias is not None
    spec = BlockSpec(norm_position="pre" if layer.norm_first else "post", norm_affine=True, bias=bias,
                     heads=int(attention.num_heads), out_proj=True, activation=name, eps=eps)
    d = attention.embed_dim
    W = _array(attention.in_proj_weight)
    arrays = {"W_Q": W[:d].T, "W_K": W[d:2 * d].T, "W_V": W[2 * d:].T, "W_O": _array(attention.out_proj.weight).T,
              "gamma_1": _array(layer.norm1.weight), "beta_1": _array(layer.norm1.bias),
              "W_1": _array(layer.linear1.weight).T, "W_2": _array(layer.linear2.weight).T,
              "gamma_2": _array(layer.norm2.weight), "beta_2": _array(layer.norm2.bias)}
    if bias:
        b = _array(attention.in_proj_bias)
        arrays.update(b_Q=b[:d], b_K=b[d:2 * d], b_V=b[2 * d:], b_O=_array(attention.out_proj.bias),
                      b_1=_array(layer.linear1.bias), b_2=_array(layer.linear2.bias))
    elif layer.linear1.bias is not None or attention.out_proj.bias is not None:
        raise ValueError("from_torch: biases on some linear maps but not on the attention's projections")
    return spec, BlockParams.from_arrays(spec, {k: np.ascontiguousarray(v) for k, v in arrays.items()})


_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def _gpt2_block(block: Any) -> tuple[BlockSpec, BlockParams]:
    attention, mlp = block.attn, block.mlp
    config = getattr(attention, "config", None)
    if getattr(block, "crossattention", None) is not None or getattr(attention, "is_cross_attention", False):
        raise ValueError("from_torch: cross-attention is not supported")
    if not getattr(attention, "scale_attn_weights", True) or getattr(attention, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("from_torch: GPT-2 attention must scale by 1/sqrt(head_dim) only (scale_attn_weights=True, "
                         "scale_attn_by_inverse_layer_idx=False)")
    activation = getattr(config, "activation_function", None)
    if activation not in _GPT2_ACTIVATIONS:
        raise ValueError(f"from_torch: GPT-2 activation {activation!r} is not supported")
    if block.training and config is not None and max(config.attn_pdrop, config.resid_pdrop) > 0:
        warnings.warn("from_torch: the block is in training mode with dropout; blockhess's block has no dropout "
                      "(it equals the block in eval mode)", stacklevel=3)
    eps = _norm_eps(block.ln_1, block.ln_2)
    spec = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=int(attention.num_heads), out_proj=True,
                     activation=_GPT2_ACTIVATIONS[activation], causal=True, eps=eps)
    d = attention.embed_dim
    W, b = _array(attention.c_attn.weight), _array(attention.c_attn.bias)  # Conv1D: (in, out)
    arrays = {"W_Q": W[:, :d], "b_Q": b[:d], "W_K": W[:, d:2 * d], "b_K": b[d:2 * d], "W_V": W[:, 2 * d:],
              "b_V": b[2 * d:], "W_O": _array(attention.c_proj.weight), "b_O": _array(attention.c_proj.bias),
              "gamma_1": _array(block.ln_1.weight), "beta_1": _array(block.ln_1.bias),
              "W_1": _array(mlp.c_fc.weight), "b_1": _array(mlp.c_fc.bias),
              "W_2": _array(mlp.c_proj.weight), "b_2": _array(mlp.c_proj.bias),
              "gamma_2": _array(block.ln_2.weight), "beta_2": _array(block.ln_2.bias)}
    return spec, BlockParams.from_arrays(spec, {k: np.ascontiguousarray(v) for k, v in arrays.items()})
