"""Row softmax and its exact first and second derivatives (docs/derivation.md §3.2; Ormaniec et al. Lemma C.1).

``A = softmax(T)`` row by row for ``T`` of shape ``(m, n)`` (``L x L`` in the paper, any ``m x n``
here). Row ``i`` of ``A`` depends only on row ``i`` of ``T``, so the derivatives are block diagonal;
``layout="blocks"`` returns just the blocks.

Finite inputs always give finite results here (no finiteness pass over them): every row of A lies
in [0, 1] (the row maximum is subtracted before exp), and the derivatives are products of at most
three entries of A.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _working_memory
from ._interop import returns_callers_kind
from ._validate import choice, contiguous, float_array, require_output_fits

_LAYOUTS = ("dense", "blocks")


def _prepare(T: Any):
    T = float_array(T, "T", ndim=2)
    m, n = T.shape
    if m < 1 or n < 1:
        raise ValueError(f"T must have shape (m, n) with m, n >= 1, got {T.shape}")
    _backend.on_device(T)
    return contiguous(T, T.dtype)


def _require_fits(shape, dtype, layout: str, what: str, m: int, n: int) -> None:
    """Refuses a result (named ``what`` in the message) that does not fit the memory budget."""
    working = _working_memory.softmax(m, n, np.dtype(dtype).itemsize)
    if layout == "dense":
        what = f"the dense softmax {what}"
        require_output_fits(shape, dtype, what, 'use layout="blocks"', working=working)
    else:
        what = f"the softmax {what} blocks"
        require_output_fits(shape, dtype, what, "pass fewer rows of T at a time", working=working)


@returns_callers_kind
def softmax(T: Any) -> np.ndarray:
    """``softmax(T)`` over each row (the last axis); same shape and dtype as ``T``."""
    T = _prepare(T)
    require_output_fits(T.shape, T.dtype, "softmax(T)", "pass fewer rows of T at a time")
    out = _backend.empty(T.shape, T.dtype, like=T)
    _backend.kernels_for(T).softmax_forward(T, out)
    return out


@returns_callers_kind
def softmax_jacobian(T: Any, *, layout: str = "dense") -> np.ndarray:
    """Exact Jacobian of the row softmax, ``d vec_r A / d vec_r T``.

    ``layout="dense"`` gives ``(m*n, m*n)``; ``layout="blocks"`` gives ``(m, n, n)`` with
    ``[i, j, k] = dA[i,j]/dT[i,k] = A[i,j] (delta_jk - A[i,k])`` (the only nonzero part).
    """
    layout = choice(layout, "layout", _LAYOUTS)
    T = _prepare(T)
    m, n = T.shape
    shape, kind = ((m * n, m * n), 1) if layout == "dense" else ((m, n, n), 0)
    _require_fits(shape, T.dtype, layout, "Jacobian", m, n)
    out = _backend.empty(shape, T.dtype, like=T)
    _backend.kernels_for(T).softmax_jacobian(T, kind, out)
    return out


@returns_callers_kind
def softmax_hessian(T: Any, *, layout: str = "dense") -> np.ndarray:
    """Exact second derivative of the row softmax with respect to ``T``.

    ``layout="dense"`` gives the paper's layout ``((m*n)**2, m*n)`` (docs/derivation.md §1.1; row
    index = (output, first input)); ``layout="blocks"`` gives ``(m, n, n, n)`` with
    ``[i, j, k, l] = d2 A[i,j] / dT[i,k] dT[i,l]``, symmetric in ``(k, l)``.
    """
    layout = choice(layout, "layout", _LAYOUTS)
    T = _prepare(T)
    m, n = T.shape
    N = m * n
    shape, kind = ((N * N, N), 1) if layout == "dense" else ((m, n, n, n), 0)
    _require_fits(shape, T.dtype, layout, "second derivative", m, n)
    out = _backend.empty(shape, T.dtype, like=T)
    _backend.kernels_for(T).softmax_hessian(T, kind, out)
    return out
