"""LayerNorm: forward pass and exact first and second derivatives (spec §3.3-3.4).

Row-wise over the last axis, population variance, optional ``eps``, ``gamma`` and ``beta``.
Derivatives are with respect to ``X`` in the row-major (vec_r) numerator layout of the spec.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _core, _gpu
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


def layernorm(X: Any, eps: float = 0.0, gamma: Any = None, beta: Any = None) -> np.ndarray:
    """LN(X) row by row: ``gamma * (X - mean) / sqrt(var + eps) + beta``; same shape and dtype as X."""
    X, eps, dtype, gamma, beta, _ = _prepare(X, eps, gamma, beta)
    if _backend.on_device(X, gamma, beta):
        return _gpu.layernorm(X, eps, gamma, beta)
    out = np.empty_like(X)
    _core.layernorm_forward(X, eps, gamma, beta, out)
    return out


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
    if wrt == "X":
        shape, kind = ((L * d, L * d), 1) if layout == "dense" else ((L, d, d), 0)
        require_output_fits(shape, dtype, "the dense LayerNorm Jacobian", 'use layout="blocks"')
    else:
        shape, kind = (L * d, d), (2 if wrt == "gamma" else 3)
    if _backend.on_device(X, gamma):
        return _gpu.layernorm_jacobian(X, eps, gamma, layout, wrt)
    out = np.empty(shape, dtype=dtype)
    _core.layernorm_jacobian(X, eps, gamma, kind, out)
    return out


def layernorm_hessian(X: Any, *, eps: float = 0.0, gamma: Any = None, layout: str = "dense") -> np.ndarray:
    """Exact second derivative of LN(X) with respect to X.

    ``layout="dense"`` gives the spec's layout ``((L*d)**2, L*d)`` (row index = (output, first
    input)); ``layout="blocks"`` gives ``(L, d, d, d)`` with ``[i, a, b, c] = d2 Z_ia / dX_ib dX_ic``.
    """
    layout = choice(layout, "layout", _LAYOUTS)
    X, eps, dtype, gamma, _, _ = _prepare(X, eps, gamma)
    L, d = X.shape
    shape, kind = (((L * d) ** 2, L * d), 1) if layout == "dense" else ((L, d, d, d), 0)
    require_output_fits(
        shape, dtype, "the dense LayerNorm second derivative",
        'use layout="blocks" or layernorm_hessian_contract',
    )
    if _backend.on_device(X, gamma):
        return _gpu.layernorm_hessian(X, eps, gamma, layout)
    out = np.empty(shape, dtype=dtype)
    _core.layernorm_hessian(X, eps, gamma, kind, out)
    return out


def layernorm_hessian_contract(X: Any, G: Any, *, eps: float = 0.0, gamma: Any = None) -> np.ndarray:
    """Second derivative contracted with an output cotangent G (L, d): ``C[i] = sum_a G[i,a] H_i[a]``.

    Returns ``(L, d, d)``; block ``i`` is the Hessian of ``sum_a G[i,a] Z[i,a]`` with respect to row i.
    """
    X, eps, dtype, gamma, _, G = _prepare(X, eps, gamma, G=G)
    if G is None:
        raise TypeError("G must be an array of shape (L, d), got None")
    L, d = X.shape
    if _backend.on_device(X, G, gamma):
        return _gpu.layernorm_hessian_contract(X, G, eps, gamma)
    out = np.empty((L, d, d), dtype=dtype)
    _core.layernorm_hessian_contract(X, eps, gamma, G, out)
    return out
