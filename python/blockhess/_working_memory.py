"""Working memory of the core's calls, in bytes: what each C++ entry point allocates besides its
result, so that the memory budget covers every allocation that grows with the input.

Every count is the core's: a block's or model's calls and the attention and FFN components from
their wired graphs (engine/working_memory.hpp, components.hpp), LayerNorm's and softmax's from their
bindings, beside the buffers they allocate (a slight over-count is intended: the budget is a guard,
not an accountant). tests/test_trust.py checks them against the peak memory of real calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _core


def layernorm(L: int, d: int, itemsize: int, *, dense_hessian: bool = False) -> int:
    """A LayerNorm call: its normalised rows and deviations, and the dense second derivative's scratch."""
    return itemsize * int(_core.layernorm_working_memory(L, d, dense_hessian))


def softmax(m: int, n: int, itemsize: int) -> int:
    """A softmax derivative of m rows of n: the probabilities."""
    return itemsize * int(_core.softmax_working_memory(m, n))


_ATTENTION_WRT = {None: -1, "W_Q": 0, "W_K": 1, "W_V": 2, "X": 3}


def attention(L: int, d: int, dk: int, dv: int, itemsize: int, wrt: str | None = None) -> int:
    """attention_forward (wrt None) or attention_jacobian: components.hpp, from the sublayer's graph."""
    from ._threads import get_num_threads

    return itemsize * int(_core.attention_working_memory(L, d, dk, dv, _ATTENTION_WRT[wrt], get_num_threads()))


def ffn(L: int, d: int, f: int, e: int, itemsize: int, kind: int = -1) -> int:
    """ffn_forward (kind -1) or ffn_jacobian of components.hpp's FfnJacobian code: from the sublayer's graph."""
    from ._threads import get_num_threads

    return itemsize * int(_core.ffn_working_memory(L, d, f, e, kind, get_num_threads()))


def ffn_cross(L: int, d: int, f: int, e: int, itemsize: int, dense: bool) -> int:
    """ffn_cross_hessian (blocks or dense): from the sublayer's graph (components.hpp)."""
    from ._threads import get_num_threads

    return itemsize * int(_core.ffn_cross_working_memory(L, d, f, e, int(dense), get_num_threads()))


# engine::Call's codes (engine/working_memory.hpp).
_CALLS = {"gradient": 0, "loss_hessian": 1, "diagonal": 2, "products": 3, "jacobian": 4, "output_hessian": 5}


def model(spec: Any, dims: tuple[int, int, int, int], B: int, L: int, itemsize: int, call: str, *,
          loss: str | None = None, head_classes: int = 0, part_code: int = 0,
          selected: Sequence[bool] | None = None, columns: int = 1) -> int:
    """The bytes the core says ``call`` would allocate on a block or model of ``spec`` with dims =
    (d, d_k, d_v, d_ff) at (B, L) besides its result: engine/working_memory.hpp, from the model's
    wiring, computing nothing. loss: None for jacobian and output_hessian; head_classes: a pooled
    head's W_C columns; selected: one flag per parameter (all where None); columns: the products'."""
    from ._threads import get_num_threads
    from .spec import loss_names

    d, d_k, d_v, d_ff = dims
    if selected is None:
        selected = [True] * len(_core.block_parameters(spec._core(), d, d_k, d_v, d_ff))
    code = -1 if loss is None else loss_names().index(loss)
    return int(_core.working_memory(spec._core(), B, L, d, d_k, d_v, d_ff, _CALLS[call], code, head_classes,
                                    part_code, [bool(s) for s in selected], columns, get_num_threads(), itemsize))
