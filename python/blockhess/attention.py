"""Single-head self-attention and its exact Jacobians (docs/derivation.md §2.1, §3.3).

``F = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V`` with ``X`` (L, d), ``W_Q`` and ``W_K`` (d, d_k),
``W_V`` (d, d_v): no mask, no biases, no output projection. The paper has ``d_v = d``; any ``d_v``
works here. Jacobians are in the vec_r numerator layout, shape ``(L*d_v, n_wrt)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _working_memory
from ._interop import returns_callers_kind
from ._validate import choice, common_dtype, contiguous, float_array, require_output_fits

_WRT = ("W_Q", "W_K", "W_V", "X")


def _prepare(X: Any, W_Q: Any, W_K: Any, W_V: Any):
    X = float_array(X, "X", ndim=2)
    W_Q = float_array(W_Q, "W_Q", ndim=2)
    W_K = float_array(W_K, "W_K", ndim=2)
    W_V = float_array(W_V, "W_V", ndim=2)
    L, d = X.shape
    if L < 1 or d < 1:
        raise ValueError(f"X must have shape (L, d) with L, d >= 1, got {X.shape}")
    d_k = W_Q.shape[1]
    if W_Q.shape[0] != d or d_k < 1:
        raise ValueError(
            f"W_Q must have shape ({d}, d_k) with d_k >= 1 to match X of shape {X.shape}, got {W_Q.shape}"
        )
    if W_K.shape != W_Q.shape:
        raise ValueError(f"W_K must have the shape of W_Q {W_Q.shape}, got {W_K.shape}")
    if W_V.shape[0] != d or W_V.shape[1] < 1:
        raise ValueError(
            f"W_V must have shape ({d}, d_v) with d_v >= 1 to match X of shape {X.shape}, got {W_V.shape}"
        )
    _backend.on_device(X, W_Q, W_K, W_V)
    dtype = common_dtype(X, W_Q, W_K, W_V)
    return tuple(contiguous(a, dtype) for a in (X, W_Q, W_K, W_V)) + (dtype,)


@returns_callers_kind
def attention(X: Any, W_Q: Any, W_K: Any, W_V: Any) -> np.ndarray:
    """``softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V``, shape (L, d_v)."""
    X, W_Q, W_K, W_V, dtype = _prepare(X, W_Q, W_K, W_V)
    (L, d), d_k, d_v = X.shape, W_Q.shape[1], W_V.shape[1]
    require_output_fits((L, d_v), dtype, "the attention output", "pass fewer tokens at a time",
                        working=_working_memory.attention(L, d, d_k, d_v, dtype.itemsize))
    out = _backend.empty((L, d_v), dtype, like=X)
    _backend.kernels_for(X, W_Q, W_K, W_V).attention_forward(X, W_Q, W_K, W_V, out)  # checked finite
    return out


@returns_callers_kind
def attention_jacobian(X: Any, W_Q: Any, W_K: Any, W_V: Any, wrt: str) -> np.ndarray:
    """Exact Jacobian of the attention output ``F`` (L, d_v) with respect to ``wrt``.

    ``wrt`` is one of ``"W_Q"``, ``"W_K"`` (both give ``(L*d_v, d*d_k)``), ``"W_V"``
    (``(L*d_v, d*d_v)``) or ``"X"`` (``(L*d_v, L*d)``). These are the paper's G_Q, G_K (with the
    corrected commutation matrix of erratum E10) and G_V, read from the engine's per-token factors
    without forming Kronecker or commutation matrices; the X Jacobian (not in the paper,
    docs/derivation.md §3.3) is one forward tangent per entry of X: L*d tangents, each costing
    about one forward pass (O(L d (2 d_k + d_v) + L^2 (d_k + d_v))).
    """
    wrt = choice(wrt, "wrt", _WRT)
    X, W_Q, W_K, W_V, dtype = _prepare(X, W_Q, W_K, W_V)
    (L, d), d_k, d_v = X.shape, W_Q.shape[1], W_V.shape[1]
    n_wrt = {"W_Q": d * d_k, "W_K": d * d_k, "W_V": d * d_v, "X": L * d}[wrt]
    shape = (L * d_v, n_wrt)
    what = f"the attention Jacobian with respect to {wrt}"
    require_output_fits(shape, dtype, what, "use fewer tokens",
                        working=_working_memory.attention(L, d, d_k, d_v, dtype.itemsize, wrt))
    out = _backend.empty(shape, dtype, like=X)
    _backend.kernels_for(X, W_Q, W_K, W_V).attention_jacobian(X, W_Q, W_K, W_V, _WRT.index(wrt), out)  # checked finite
    return out
