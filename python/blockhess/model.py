"""A stack of Transformer blocks: :class:`ModelSpec`, a frozen, hashable value. ``n_layers`` blocks of
one :class:`BlockSpec`, each on the previous one's output (the core wires them: ``blocks/family.hpp``,
``wire_stack``); the parameters of layer l are the block's, named ``h.<l>.<name>`` (``h.0.W_Q``, ...),
layer after layer. One layer is the block itself, with its own names.

Every function that takes a block's parameters takes a stack's (``BlockParams.random(ModelSpec(...),
...)``, ``from_arrays``): the loss, its gradient and its Hessian-vector products cover every layer
exactly; the dense Hessian and its diagonal cover the last layer's parameters so far (``wrt=``): a
lower layer's reach the next block's attention through its input, which the per-token factors do not
cover yet (docs/derivation.md §4.3), and asking for them is a ValueError that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import positive_int
from .spec import PAPER_BLOCK, BlockSpec


_BLOCK_OPTIONS = frozenset({"heads", "out_proj", "attention_only", "norm_position", "eps"})


@dataclass(frozen=True)
class ModelSpec:
    """``n_layers`` blocks of ``block``, stacked."""

    block: BlockSpec = PAPER_BLOCK
    n_layers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.block, BlockSpec):
            raise TypeError(f"ModelSpec.block must be a blockhess.BlockSpec, got {type(self.block).__name__}")
        object.__setattr__(self, "n_layers", positive_int(self.n_layers, "ModelSpec.n_layers"))

    def __getattr__(self, name: str):
        """The block's options that the functions read of a spec (heads, out_proj, ...)."""
        if name in _BLOCK_OPTIONS:
            return getattr(self.block, name)
        raise AttributeError(f"ModelSpec has no attribute {name!r}")

    @property
    def is_paper_block(self) -> bool:
        return self.n_layers == 1 and self.block.is_paper_block

    def layer_prefix(self, layer: int) -> str:
        """The name prefix of a layer's parameters: "h.<layer>.", or none for a lone block (params.hpp)."""
        return "" if self.n_layers == 1 else f"h.{layer}."

    def _core(self) -> tuple:
        """The tuple the core's bindings take (block_problem.hpp, SpecTuple): the block's, its layers."""
        return (*self.block._core()[:-1], self.n_layers)
