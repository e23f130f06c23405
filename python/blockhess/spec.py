"""Which Transformer block: :class:`BlockSpec`, a frozen, hashable value (the paper's block is the
default). The parameters each spec has, their names, shapes and order come from the core's
registry (``cpp/include/blockhess/params.hpp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _core
from ._validate import nonneg_scalar, positive_int



def norm_position_names() -> tuple[str, ...]:
    """Where a BlockSpec's norms may sit: the core's registry (params.hpp), a name's code its index.
    Read when needed, not at import, so that importing blockhess never depends on it."""
    return tuple(_core.norm_positions)


def norm_names() -> tuple[str, ...]:
    """The norms a BlockSpec accepts: the core's registry (params.hpp), a name's code its index."""
    return tuple(_core.norms)


def activation_names() -> tuple[str, ...]:
    """The activations a BlockSpec accepts: the core's registry (activation.hpp), where a name's code
    is its index. Read when needed, not at import, so that importing blockhess never depends on it."""
    return tuple(_core.activations)


def loss_names() -> tuple[str, ...]:
    """The losses the functions' ``loss=`` accepts: the core's registry of heads (heads.hpp), where a
    name's code is its index. Read when needed, like :func:`activation_names`."""
    return tuple(_core.losses)


@dataclass(frozen=True)
class BlockSpec:
    """A block of the family.

    - ``norm_position``: "post" (the paper's: ``Y = N_1(X + attn(X)), Z = N_2(Y + ffn(Y))``) or
      "pre" (GPT-2's: ``Y = X + attn(N_1(X)), Z = Y + ffn(N_2(Y))``);
    - ``norm``: "layernorm" (population variance) or "rmsnorm";
    - ``norm_affine``: trainable gamma (and beta) in both norms;
    - ``bias``: a bias on every linear map (b_Q, b_K, b_V, b_O, b_1, b_2);
    - ``heads``, ``out_proj`` (W_O after the heads); without ``out_proj``, heads * d_v == d;
    - ``activation``: "relu", "gelu" (erf form), "gelu_tanh" or "silu";
    - ``causal``: keys after the query are masked;
    - ``eps``: the norms' epsilon, used when a function is called without ``eps=``;
    - ``attention_only``: the self-attention sublayer alone, ``Z = attn(X)`` (with its heads,
      biases, W_O and mask; no residual, no norms, no FFN): the lone layer of the paper's Thm 1.
      Its parameters are W_Q, W_K, W_V (and b_Q, b_K, b_V, W_O, b_O); the norm and FFN options
      (``norm_position``, ``norm``, ``norm_affine``, ``activation``) must keep their defaults.

    """

    norm_position: str = "post"
    norm: str = "layernorm"
    norm_affine: bool = False
    bias: bool = False
    heads: int = 1
    out_proj: bool = False
    activation: str = "relu"
    causal: bool = False
    eps: float = 0.0
    attention_only: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("norm_position", norm_position_names()), ("norm", norm_names()),
                              ("activation", activation_names())):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"BlockSpec.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        # NumPy's scalars are accepted like Python's and stored as Python's (the spec stays hashable
        # and compares equal whichever kind it was given).
        for name in ("norm_affine", "bias", "out_proj", "causal", "attention_only"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"BlockSpec.{name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "heads", positive_int(self.heads, "BlockSpec.heads"))
        object.__setattr__(self, "eps", nonneg_scalar(self.eps, "BlockSpec.eps"))
        if self.attention_only:
            # An attention-only block has no norm and no FFN: options about them would be ignored.
            for name, default in (("norm_position", "post"), ("norm", "layernorm"), ("norm_affine", False),
                                  ("activation", "relu")):
                if getattr(self, name) != default:
                    raise ValueError(f"BlockSpec.{name}={getattr(self, name)!r} means nothing with attention_only=True "
                                     f"(no norms, no FFN); leave it at {default!r}")

    @property
    def is_paper_block(self) -> bool:
        """The paper's block: post-LN, no affine norms, no biases, one head, relu, not causal, a
        whole block (not attention_only)."""
        return (self.norm_position, self.norm, self.norm_affine, self.bias, self.heads, self.out_proj,
                self.activation, self.causal, self.attention_only) == ("post", "layernorm", False, False, 1, False,
                                                                       "relu", False, False)

    def _core(self) -> tuple[Any, ...]:
        """The tuple the core's bindings take (bind_block.cpp, SpecTuple)."""
        return (norm_position_names().index(self.norm_position), norm_names().index(self.norm), self.norm_affine,
                self.bias, self.heads, self.out_proj, activation_names().index(self.activation), self.causal,
                self.attention_only, 1, False, 0, 0, False, 0, 0, False)  # one layer; none of a model's extras

    @property
    def n_layers(self) -> int:
        """One: a block is a one-layer stack (model.py's ModelSpec has more)."""
        return 1

    @property
    def reads_tokens(self) -> bool:
        """False: a block reads (B, L, d) floats (a language model's ModelSpec reads token ids)."""
        return False

    # A block has no embedding, learned positions, LM head or classifier (a ModelSpec may have).
    vocab_size = property(lambda self: 0)
    n_positions = property(lambda self: 0)
    lm_head = property(lambda self: False)
    patch_dim = property(lambda self: 0)
    classes = property(lambda self: 0)
    class_token = property(lambda self: False)

    def tokens(self, L: int) -> int:
        """A block's tokens are its input's."""
        return L

    def layer_prefix(self, layer: int) -> str:
        """A lone block's parameters have no layer prefix (a stack's: model.py's ModelSpec)."""
        return ""


PAPER_BLOCK = BlockSpec()
