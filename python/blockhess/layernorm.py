"""LayerNorm: forward pass and exact first and second derivatives (docs/derivation.md §3.1).

Row-wise over the last axis, population variance, optional ``eps``, ``gamma`` and ``beta``.
Derivatives are with respect to ``X`` in the row-major (vec_r) numerator layout of the spec.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _working_memory
from ._interop import returns_callers_kind
from ._validate import (
    choice,
    common_dtype,
    contiguous,
    float_array,
    nonneg_scalar,
    require_output_fits,
)

_LAYOUTS = ("dense", "blocks")


def _prepare(X: Any, eps: Any, gamma: Any = None, beta: Any = None, G: Any = None):
    X = float_array(X, "X", ndim=2)
    L, d = X.shape
    if L < 1 or d < 1:
        raise ValueError(f"X must have shape (L, d) with L, d >= 1, got {X.shape}")
    eps = nonneg_scalar(eps, "eps")
    extras = []
    for name, v, shape in (("gamma", gamma, (d,)), ("beta", beta, (d,)), ("G", G, (L, d))):
        if v is not None:
            v = float_array(v, name)
            if v.shape != shape:
                raise ValueError(f"{name} must have shape {shape} to match X of shape {X.shape}, got {v.shape}")
        extras.append(v)
    _backend.on_device(X, *extras)
    dtype = common_dtype(X, *extras)
    # A zero-variance row with eps=0 is refused by the core with a ValueError suggesting eps > 0.
    return (contiguous(X, dtype), eps, dtype, *[contiguous(v, dtype) for v in extras])


@returns_callers_kind
def layernorm(X: Any, eps: float = 0.0, gamma: Any = None, beta: Any = None) -> np.ndarray:
    """LN(X) row by row: ``gamma * (X - mean) / sqrt(var + eps) + beta``; same shape and dtype as X."""
    X, eps, dtype, gamma, beta, _ = _prepare(X, eps, gamma, beta)
    require_output_fits(X.shape, dtype, "LN(X)", "pass fewer rows at a time",
                        working=_working_memory.layernorm(X.shape[0], 1, dtype.itemsize))
    out = _backend.empty(X.shape, dtype, like=X)
    _backend.kernels_for(X, gamma, beta).layernorm_forward(X, eps, gamma, beta, out)  # checked finite
    return out


@returns_callers_kind
def layernorm_jacobian(
    X: Any, *, eps: float = 0.0, gamma: Any = None, layout: str = "dense", wrt: str = "X"
) -> np.ndarray:
    """Exact Jacobian of LN(X).

    wrt="X": ``layout="dense"`` gives ``(L*d, L*d)``; ``layout="blocks"`` gives the per-token blocks
    ``(L, d, d)`` (the only nonzero part). wrt="gamma" or "beta" gives ``(L*d, d)``.
    """
    layout = choice(layout, "layout", _LAYOUTS)
    wrt = choice(wrt, "wrt", ("X", "gamma", "beta"))
    X, eps, dtype, gamma, _, _ = _prepare(X, eps, gamma)
    L, d = X.shape
    if wrt == "X" and layout == "dense":
        shape, kind, what, hint = (L * d, L * d), 1, "the dense LayerNorm Jacobian", 'use layout="blocks"'
    elif wrt == "X":
        shape, kind, what, hint = (L, d, d), 0, "the LayerNorm Jacobian blocks", "pass fewer rows at a time"
    else:
        shape, kind = (L * d, d), (2 if wrt == "gamma" else 3)
        what, hint = f"the LayerNorm Jacobian with respect to {wrt}", "pass fewer rows at a time"
    require_output_fits(shape, dtype, what, hint, working=_working_memory.layernorm(L, d, dtype.itemsize))
    out = _backend.empty(shape, dtype, like=X)
    _backend.kernels_for(X, gamma).layernorm_jacobian(X, eps, gamma, kind, out)  # checked finite
    return out


@returns_callers_kind
def layernorm_hessian(X: Any, *, eps: float = 0.0, gamma: Any = None, layout: str = "dense") -> np.ndarray:
    """Exact second derivative of LN(X) with respect to X.

    ``layout="dense"`` gives the paper's layout ``((L*d)**2, L*d)`` (docs/derivation.md §1.1; row
    index = (output, first input)); ``layout="blocks"`` gives ``(L, d, d, d)`` with ``[i, a, b, c] = d2 Z_ia / dX_ib dX_ic``.
    """
    layout = choice(layout, "layout", _LAYOUTS)
    X, eps, dtype, gamma, _, _ = _prepare(X, eps, gamma)
    L, d = X.shape
    if layout == "dense":
        shape, kind, what = ((L * d) ** 2, L * d), 1, "the dense LayerNorm second derivative"
        hint = 'use layout="blocks" or layernorm_hessian_contract'
    else:
        shape, kind, what = (L, d, d, d), 0, "the LayerNorm second-derivative blocks"
        hint = "use layernorm_hessian_contract, or pass fewer rows at a time"
    require_output_fits(shape, dtype, what, hint,
                        working=_working_memory.layernorm(L, d, dtype.itemsize, dense_hessian=layout == "dense"))
    out = _backend.empty(shape, dtype, like=X)
    _backend.kernels_for(X, gamma).layernorm_hessian(X, eps, gamma, kind, out)  # checked finite
    return out


@returns_callers_kind
def layernorm_hessian_contract(X: Any, G: Any, *, eps: float = 0.0, gamma: Any = None) -> np.ndarray:
    """Second derivative contracted with an output cotangent G (L, d): ``C[i] = sum_a G[i,a] H_i[a]``.

    Returns ``(L, d, d)``; block ``i`` is the Hessian of ``sum_a G[i,a] Z[i,a]`` with respect to row i.
    """
    X, eps, dtype, gamma, _, G = _prepare(X, eps, gamma, G=G)
    if G is None:
        raise TypeError("G must be an array of shape (L, d), got None")
    L, d = X.shape
    what = "the contracted LayerNorm second derivative"
    require_output_fits((L, d, d), dtype, what, "pass fewer rows at a time",
                        working=_working_memory.layernorm(L, d, dtype.itemsize))
    out = _backend.empty((L, d, d), dtype, like=X)
    _backend.kernels_for(X, G, gamma).layernorm_hessian_contract(X, eps, gamma, G, out)  # checked finite
    return out
