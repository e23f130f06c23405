"""The FFN sublayer ``relu(Y W_1) W_2`` (no residual, no biases) and its exact derivatives (docs/derivation.md §3.4).

``Y`` (L, d), ``W_1`` (d, d_ff), ``W_2`` (d_ff, d_out); the paper has ``d_out = d``. Derivatives
are in the vec_r numerator layout. ReLU convention: the derivative at exactly 0 is taken as 0
(as in PyTorch), and ReLU's second derivative is 0 (docs/derivation.md §3.4), so the derivatives are exact
wherever no pre-activation ``Y W_1`` is exactly 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _working_memory
from ._interop import returns_callers_kind
from ._validate import choice, common_dtype, contiguous, float_array, require_output_fits

_LAYOUTS = ("dense", "blocks")


def _prepare(Y: Any, W_1: Any, W_2: Any):
    Y = float_array(Y, "Y", ndim=2)
    W_1 = float_array(W_1, "W_1", ndim=2)
    W_2 = float_array(W_2, "W_2", ndim=2)
    L, d = Y.shape
    if L < 1 or d < 1:
        raise ValueError(f"Y must have shape (L, d) with L, d >= 1, got {Y.shape}")
    d_ff = W_1.shape[1]
    if W_1.shape[0] != d or d_ff < 1:
        raise ValueError(
            f"W_1 must have shape ({d}, d_ff) with d_ff >= 1 to match Y of shape {Y.shape}, got {W_1.shape}"
        )
    if W_2.shape[0] != d_ff or W_2.shape[1] < 1:
        raise ValueError(f"W_2 must have shape ({d_ff}, d_out) to match W_1 of shape {W_1.shape}, got {W_2.shape}")
    _backend.on_device(Y, W_1, W_2)
    dtype = common_dtype(Y, W_1, W_2)
    return contiguous(Y, dtype), contiguous(W_1, dtype), contiguous(W_2, dtype), dtype


@returns_callers_kind
def ffn(Y: Any, W_1: Any, W_2: Any) -> np.ndarray:
    """``relu(Y W_1) W_2``, shape (L, d_out)."""
    Y, W_1, W_2, dtype = _prepare(Y, W_1, W_2)
    (L, d), d_ff, d_out = Y.shape, W_1.shape[1], W_2.shape[1]
    require_output_fits((L, d_out), dtype, "the FFN output", "pass fewer tokens at a time",
                        working=_working_memory.ffn(L, d, d_ff, d_out, dtype.itemsize))
    out = _backend.empty((L, d_out), dtype, like=Y)
    _backend.kernels_for(Y, W_1, W_2).ffn_forward(Y, W_1, W_2, out)  # checked finite
    return out


@returns_callers_kind
def ffn_jacobian(Y: Any, W_1: Any, W_2: Any, wrt: str, *, layout: str = "dense") -> Any:
    """Exact Jacobian of ``FFN(Y)`` (L, d_out) with respect to ``wrt``.

    ``wrt="W_1"`` gives the paper's B_1, ``(L*d_out, d*d_ff)``; ``wrt="W_2"`` gives B_2,
    ``(L*d_out, d_ff*d_out)``; ``wrt="Y"`` gives ``(L*d_out, L*d)``, which is block diagonal, so
    ``layout="blocks"`` returns just the blocks ``(L, d_out, d)`` (block t is W_2^T D_t W_1^T).

    For the weights, ``layout="kron"`` returns the per-token Kronecker factors ``(U, V)`` instead of
    the dense array: ``J[t*d_out + c, p*n + q] = U[t, p] * V[t, c, q]``, i.e.
    ``J = np.einsum("tp,tcq->tcpq", U, V).reshape(J.shape)``. For W_1, ``U = Y`` (L, d) and
    ``V[t, c, g] = relu'((Y W_1)[t, g]) W_2[g, c]`` (L, d_out, d_ff); for W_2, ``U = relu(Y W_1)``
    (L, d_ff) and ``V[t] = I`` (a read-only view). They hold 1/d (W_1) of the dense entries.
    """
    wrt = choice(wrt, "wrt", ("W_1", "W_2", "Y"))
    layout = choice(layout, "layout", (*_LAYOUTS, "kron"))
    if layout == "blocks" and wrt != "Y":
        raise ValueError(f'layout="blocks" is only available for wrt="Y", got wrt={wrt!r}')
    if layout == "kron" and wrt == "Y":
        raise ValueError('layout="kron" is only available for wrt="W_1" or "W_2"; use layout="blocks" for "Y"')
    Y, W_1, W_2, dtype = _prepare(Y, W_1, W_2)
    (L, d), d_ff, d_out = Y.shape, W_1.shape[1], W_2.shape[1]
    if layout == "kron":
        return _kron_factors(Y, W_1, W_2, wrt, dtype)
    if wrt == "W_1":
        shape, kind, hint = (L * d_out, d * d_ff), 0, 'use layout="kron"'
    elif wrt == "W_2":
        shape, kind, hint = (L * d_out, d_ff * d_out), 1, 'use layout="kron"'
    elif layout == "dense":
        shape, kind, hint = (L * d_out, L * d), 2, 'use layout="blocks"'
    else:
        shape, kind, hint = (L, d_out, d), 3, "use fewer tokens"
    what = f"the FFN Jacobian with respect to {wrt}" + (" (blocks)" if layout == "blocks" else "")
    require_output_fits(shape, dtype, what, hint, working=_working_memory.ffn(L, d, d_ff, d_out, dtype.itemsize, kind))
    out = _backend.empty(shape, dtype, like=Y)
    _backend.kernels_for(Y, W_1, W_2).ffn_jacobian(Y, W_1, W_2, kind, out)  # checked finite
    return out


def _kron_factors(Y: Any, W_1: Any, W_2: Any, wrt: str, dtype: np.dtype):
    (L, d), d_ff, d_out = Y.shape, W_1.shape[1], W_2.shape[1]
    what = f"the Kronecker factors of the FFN Jacobian with respect to {wrt}"
    # U and V together: (L, d) and (L, d_out, d_ff) for W_1, (L, d_ff) and an identity for W_2.
    factors = (L * d + L * d_out * d_ff,) if wrt == "W_1" else (L * d_ff + d_out * d_out,)
    require_output_fits(factors, dtype, what, "pass fewer tokens at a time",
                        working=_working_memory.ffn(L, d, d_ff, d_out, dtype.itemsize, 4 if wrt == "W_1" else 5))
    kernels, xp = _backend.kernels_for(Y, W_1, W_2), _backend.array_module(Y)
    if wrt == "W_1":
        V = _backend.empty((L, d_out, d_ff), dtype, like=Y)
        kernels.ffn_jacobian(Y, W_1, W_2, 4, V)  # relu'(Y W_1) W_2: finite whenever W_2 is
        return Y.copy(), V
    U = _backend.empty((L, d_ff), dtype, like=Y)
    kernels.ffn_jacobian(Y, W_1, W_2, 5, U)  # checked finite
    with _backend.device_of(Y):
        return U, xp.broadcast_to(xp.eye(d_out, dtype=dtype), (L, d_out, d_out))


@returns_callers_kind
def ffn_cross_hessian(Y: Any, W_1: Any, W_2: Any, *, layout: str = "dense") -> np.ndarray:
    """Exact cross second derivative ``d2 FFN / dW_1 dW_2``.

    ``layout="dense"`` gives the paper's layout ``(L*d_out*d*d_ff, d_ff*d_out)``: entry
    ``[(t*d_out + c)*d*d_ff + b*d_ff + f, f2*d_out + c2] = d2 F[t,c] / dW_1[b,f] dW_2[f2,c2]``,
    which is ``delta(f, f2) delta(c, c2) Y[t,b] 1[(Y W_1)[t,f] > 0]`` (the corrected form of
    erratum E4). ``layout="blocks"`` returns only those values, ``(L, d, d_ff)`` with
    ``[t, b, f] = Y[t,b] 1[(Y W_1)[t,f] > 0]``. The (W_1, W_1) and (W_2, W_2) blocks are zero.
    """
    layout = choice(layout, "layout", _LAYOUTS)
    Y, W_1, W_2, dtype = _prepare(Y, W_1, W_2)
    (L, d), d_ff, d_out = Y.shape, W_1.shape[1], W_2.shape[1]
    if layout == "dense":
        shape, kind, hint = (L * d_out * d * d_ff, d_ff * d_out), 1, 'use layout="blocks"'
    else:
        shape, kind, hint = (L, d, d_ff), 0, "use fewer tokens"
    what = "the dense FFN cross second derivative" if layout == "dense" else "the FFN cross second-derivative blocks"
    working = _working_memory.ffn_cross(L, d, d_ff, d_out, dtype.itemsize, dense=layout == "dense")
    require_output_fits(shape, dtype, what, hint, working=working)
    out = _backend.empty(shape, dtype, like=Y)
    _backend.kernels_for(Y, W_1, W_2).ffn_cross_hessian(Y, W_1, W_2, kind, out)  # Y times 0 or 1: finite
    return out
