"""A model of Transformer blocks: :class:`ModelSpec`, a frozen, hashable value. ``n_layers`` blocks of
one :class:`BlockSpec`, each on the previous one's output (the core wires them: ``blocks/family.hpp``,
``wire_stack``), then optionally a final norm of the block's kind (GPT-2's ``ln_f``,
``nn.TransformerEncoder``'s ``norm``). The parameters of layer l are the block's, named
``h.<l>.<name>`` (``h.0.W_Q``, ...), layer after layer, then the final norm's ``ln_f.gamma`` (and
``ln_f.beta``) where the block's norms are affine. One layer is the block itself, with its own names.

A language model (``vocab_size > 0``, GPT-2's shape) reads integer token ids X of shape (L,) or
(B, L): its input is their rows of the embedding ``wte`` (vocab_size, d), plus with
``n_positions > 0`` the learned positions ``wpe`` (n_positions, d), row i for position i. With
``lm_head`` its output is the logits ``Z wte^T`` (B, L, vocab_size): the LM head tied to the
embedding, as GPT-2's, one parameter counted once, its gradient and curvature summed over both
uses. Its loss is ``loss="next_token"`` (Hugging Face's causal-LM loss) or a per-token one. The
parameters start with ``wte`` and ``wpe``.

A ViT (``patch_dim > 0``) reads image patches X of shape (L, patch_dim) or (B, L, patch_dim): its
input is ``X W_E + b_E`` (W_E (patch_dim, d)), plus learned positions ``wpe`` with ``n_positions``.
With ``classes > 0`` a classifier ``W_C`` (d, classes), ``b_C`` (classes,) writes each token's
logits, and ``loss="pooled_cross_entropy"`` averages them over a sample's tokens (the logits of
the mean token) against one class per sample: the classifier is the model's, trained with it (no
``head=``). Its parameters end with ``W_C`` and ``b_C``. With ``class_token`` (Hugging Face's ViT)
every sample gets a learned first token ``cls_token`` before its patches, so the model's tokens
(its output's rows, a per-token target's) are L + 1, and ``pooled_cross_entropy`` classifies that
first token's logits instead of the mean.

Every function that takes a block's parameters takes a stack's (``BlockParams.random(ModelSpec(...),
...)``, ``from_arrays``): the loss, its gradient, its Hessian-vector products, the dense Hessian
with every cross-layer block, its diagonal and traces cover every layer exactly. The last layer's,
the final norm's and a classifier's dense Hessian and diagonal are assembled from per-token
factors; a lower layer's (and the embedding's) parameters reach the next block's attention through
its input, which the factors do not cover (docs/derivation.md §4.3), so a selection with any of them
takes one exact Hessian-vector product per parameter (§5.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _core
from ._validate import integer, positive_int
from .spec import PAPER_BLOCK, BlockSpec


_BLOCK_OPTIONS = frozenset({"heads", "out_proj", "attention_only", "norm_position", "eps"})


@dataclass(frozen=True)
class ModelSpec:
    """``n_layers`` blocks of ``block``, stacked, and a final norm when ``final_norm``; for a
    language model, a token embedding of ``vocab_size`` rows, ``n_positions`` learned positions and
    an ``lm_head`` tied to the embedding; for a ViT, a patch embedding of ``patch_dim`` features,
    a ``class_token``, learned positions and a classifier of ``classes`` classes."""

    block: BlockSpec = PAPER_BLOCK
    n_layers: int = 1
    final_norm: bool = False
    vocab_size: int = 0
    n_positions: int = 0
    lm_head: bool = False
    patch_dim: int = 0
    classes: int = 0
    class_token: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.block, BlockSpec):
            raise TypeError(f"ModelSpec.block must be a blockhess.BlockSpec, got {type(self.block).__name__}")
        object.__setattr__(self, "n_layers", positive_int(self.n_layers, "ModelSpec.n_layers"))
        if not isinstance(self.final_norm, (bool, np.bool_)):
            raise TypeError(f"ModelSpec.final_norm must be a bool, got {self.final_norm!r}")
        object.__setattr__(self, "final_norm", bool(self.final_norm))
        for name in ("vocab_size", "n_positions", "patch_dim", "classes"):
            object.__setattr__(self, name, integer(getattr(self, name), f"ModelSpec.{name}", least=0))
        for name in ("lm_head", "class_token"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"ModelSpec.{name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.class_token and not self.patch_dim:
            raise ValueError("ModelSpec: a class_token needs a patch embedding (patch_dim > 0)")
        if not self.vocab_size and self.lm_head:
            raise ValueError("ModelSpec: an lm_head needs a token embedding (vocab_size > 0)")
        if self.vocab_size and self.patch_dim:
            raise ValueError("ModelSpec: a model reads token ids (vocab_size) or patches (patch_dim), not both")
        if self.lm_head and self.classes:
            raise ValueError("ModelSpec: an lm_head or a classifier (classes), not both")
        if self.final_norm and self.block.attention_only:
            raise ValueError("ModelSpec.final_norm=True means nothing with an attention_only block (it has no norms)")

    def __getattr__(self, name: str):
        """The block's options that the functions read of a spec (heads, out_proj, ...)."""
        if name in _BLOCK_OPTIONS:
            return getattr(self.block, name)
        raise AttributeError(f"ModelSpec has no attribute {name!r}")

    @property
    def is_paper_block(self) -> bool:
        return (self.n_layers == 1 and not (self.final_norm or self.vocab_size or self.n_positions or self.patch_dim
                                            or self.classes) and self.block.is_paper_block)

    @property
    def reads_tokens(self) -> bool:
        """Whether X is token ids (a language model) rather than (B, L, d) floats."""
        return self.vocab_size > 0

    def tokens(self, L: int) -> int:
        """The model's tokens per sample for L of its input's: one more with a class token."""
        return L + 1 if self.class_token else L

    def layer_prefix(self, layer: int) -> str:
        """The name prefix of a layer's parameters: "h.<layer>.", or none for a lone block (the core's
        rule, params.hpp)."""
        return str(_core.layer_prefix(self.n_layers, layer))

    def _core(self) -> tuple:
        """The tuple the core's bindings take (block_problem.hpp, SpecTuple): the block's, then the
        model's (params.hpp's Stack)."""
        return (*self.block._core()[:-8], self.n_layers, self.final_norm, self.vocab_size, self.n_positions,
                self.lm_head, self.patch_dim, self.classes, self.class_token)
