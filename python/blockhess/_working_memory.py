"""Working memory of the core's calls, in bytes: what each C++ entry point allocates besides its
result, so that the memory budget covers every allocation that grows with the input.

A block's or model's calls ask the core (model(): engine/working_memory.hpp, from the wiring); the
component functions' small kernels are described here, each mirroring the buffers of the C++ code
named in its docstring (a slight over-count is intended: the budget is a guard, not an accountant).
tests/test_trust.py checks them against the peak memory of real calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _core


def layernorm(L: int, d: int, itemsize: int, *, dense_hessian: bool = False) -> int:
    """bind_layernorm.cpp: y (L, d) and sigma (L); a (d, d, d) row for the dense second derivative."""
    return itemsize * (L * d + L + (d**3 if dense_hessian else 0))


def softmax(m: int, n: int, itemsize: int) -> int:
    """bind_softmax.cpp: A (m, n)."""
    return itemsize * m * n


def attention(L: int, d: int, dk: int, dv: int, itemsize: int, wrt: str | None = None) -> int:
    """components.hpp on the engine's attention node: copies of X and the weights, Q, K, V, the
    logits and A (L, L), F; for a weight's Jacobian its tangent factors at F (engine/derivatives.hpp
    jacobian), for X the node's closed form's Q W_K^T and K W_Q^T (AttentionNode::input_jacobian)."""
    cache = 2 * L * L + L * (d + 2 * dk + 2 * dv) + d * (2 * dk + dv)
    extra = {None: 0, "W_Q": L * dv * dk + dv * d * dk, "W_K": L * dk + L * dv * d + dv * d * d, "W_V": L * d,
             "X": 2 * L * d}[wrt]
    return itemsize * (cache + extra)


def ffn(L: int, d: int, f: int, e: int, itemsize: int, what: str | None = None, threads: int = 1) -> int:
    """components.hpp on the engine's linear and relu nodes: copies of Y and the weights, H = Y W_1,
    relu(H) and relu'(H), F; for W_1's Jacobian or factors its tangent factors (L, e, f) at F, for Y
    one forward tangent per thread and the (L, e, d) blocks, for the cross second derivative W_1's
    factor at relu(H), a mask per thread and ("cross_dense") the (L, d, f) values."""
    cache = L * d + d * f + f * e + 3 * L * f + L * e
    cross = L * f + threads * f
    extra = {None: 0, "W_1": L * e * f + L * f, "W_2": L * f, "Y": threads * (L * d + 2 * L * f + L * e) + L * e * d,
             "cross": cross, "cross_dense": cross + L * d * f}[what]
    return itemsize * (cache + extra)


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
