"""GPU implementations of the public API (private): CuPy arrays in, CuPy arrays out.

The public functions validate and normalise their inputs (float32/float64, C-contiguous, one
dtype, all on the GPU), then call the function of the same name here. Each one runs on the device
of its first array argument and on CuPy's current stream, and allocates its outputs with CuPy.

The block's and its family's results are the engine's: its Hessians (loss_hessian,
block_output_hessian) run their per-token work on the host from copies of the (small) inputs and the
(P, P) assembly on the GPU (_cuda's bindings, cuda/'s DeviceHessian); its forward pass, Jacobians,
loss and gradient run on the host from copies and are copied back (on_host). The component
functions are written here over CuPy: per-token, structured steps go to the blockhess kernels
(through :mod:`blockhess._gpu_launch`), dense matrix products to cuBLAS through CuPy. Nothing here synchronises, except the few checks that
must raise in Python: the zero-variance test of LayerNorm rows (one reduction), the class-index
range (done by the caller) and the Hessians' finiteness.

The code only uses array operations that NumPy and CuPy share, so the tests run it on NumPy arrays
with the real kernels and bindings compiled for the CPU (tests/kernel_emulation.py) on machines
without a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _backend
from . import _gpu_launch as _k

# ---- helpers ------------------------------------------------------------------------------------


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else _backend.device_module()


_device = _backend.device_of


def _same_device(*arrays: Any) -> None:
    ids = {a.device.id for a in arrays if a is not None and not isinstance(a, np.ndarray)}
    if len(ids) > 1:
        raise ValueError(f"inputs live on different GPUs (devices {sorted(ids)}); move them to one device first")


def _c(a: Any) -> Any:
    return _xp(a).ascontiguousarray(a)


def _check_sigma(sigma: Any) -> None:
    """The CPU core's zero-variance error, from the row standard deviations the kernels wrote."""
    positive = sigma > 0
    if not bool(positive.all()):
        row = int(_xp(sigma).flatnonzero(~positive)[0])
        raise ValueError(
            f"layernorm: row {row} has zero variance (it is constant up to rounding at its scale); "
            "pass eps > 0 to make LayerNorm differentiable there"
        )


def _outer(u: Any, v: Any) -> Any:
    """Per-row outer products (n, p) x (n, q) -> (n, p, q)."""
    return u[:, :, None] * v[:, None, :]


# ---- LayerNorm ----------------------------------------------------------------------------------


def layernorm(X: Any, eps: float, gamma: Any, beta: Any) -> Any:
    xp = _xp(X)
    _same_device(X, gamma, beta)
    with _device(X):
        Z = xp.empty_like(X)
        sigma = xp.empty(X.shape[0], dtype=X.dtype)
        _k.ln_forward(X, eps, gamma, beta, Z, sigma)
        _check_sigma(sigma)
    return Z


def layernorm_jacobian(X: Any, eps: float, gamma: Any, layout: str, wrt: str) -> Any:
    xp = _xp(X)
    _same_device(X, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        if wrt == "X" and layout == "dense":
            out = xp.empty((L * d, L * d), dtype=X.dtype)
            _k.ln_jacobian_dense(X, eps, gamma, out, sigma)
        else:
            out = xp.empty((L, d, d), dtype=X.dtype)
            _k.ln_slab(X, eps, gamma, {"X": 0, "gamma": 1, "beta": 2}[wrt], out, sigma)
            if wrt != "X":
                out = out.reshape(L * d, d)
        _check_sigma(sigma)
    return out


def layernorm_hessian(X: Any, eps: float, gamma: Any, layout: str) -> Any:
    xp = _xp(X)
    _same_device(X, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        if layout == "dense":
            out = xp.empty(((L * d) ** 2, L * d), dtype=X.dtype)
            _k.ln_hessian_dense(X, eps, gamma, out, sigma)
        else:
            out = xp.empty((L, d, d, d), dtype=X.dtype)
            _k.ln_hessian_blocks(X, eps, gamma, out, sigma)
        _check_sigma(sigma)
    return out


def layernorm_hessian_contract(X: Any, G: Any, eps: float, gamma: Any) -> Any:
    xp = _xp(X)
    _same_device(X, G, gamma)
    L, d = X.shape
    with _device(X):
        sigma = xp.empty(L, dtype=X.dtype)
        out = xp.empty((L, d, d), dtype=X.dtype)
        _k.ln_hessian_contract(X, eps, gamma, G, out, sigma)
        _check_sigma(sigma)
    return out


# ---- softmax ------------------------------------------------------------------------------------


def _softmax_rows(T: Any) -> Any:
    A = _xp(T).empty_like(T)
    _k.softmax_forward(T, A)
    return A


def softmax(T: Any) -> Any:
    with _device(T):
        return _softmax_rows(T)


def softmax_jacobian(T: Any, layout: str) -> Any:
    xp = _xp(T)
    m, n = T.shape
    with _device(T):
        A = _softmax_rows(T)
        if layout == "dense":
            out = xp.empty((m * n, m * n), dtype=T.dtype)
            _k.softmax_jacobian_dense(A, out)
        else:
            out = xp.empty((m, n, n), dtype=T.dtype)
            _k.softmax_jacobian_blocks(A, out)
    return out


def softmax_hessian(T: Any, layout: str) -> Any:
    xp = _xp(T)
    m, n = T.shape
    with _device(T):
        A = _softmax_rows(T)
        if layout == "dense":
            out = xp.empty(((m * n) ** 2, m * n), dtype=T.dtype)
            _k.softmax_hessian_dense(A, out)
        else:
            out = xp.empty((m, n, n, n), dtype=T.dtype)
            _k.softmax_hessian_blocks(A, out)
    return out


# ---- commutation / Kronecker --------------------------------------------------------------------


def vec_r(A: Any) -> Any:
    with _device(A):
        return _xp(A).array(A, dtype=A.dtype, order="C").reshape(-1)


def unvec_r(v: Any, m: int, n: int) -> Any:
    with _device(v):
        return _xp(v).array(v, dtype=v.dtype, order="C").reshape(m, n)


def commute(v: Any, m: int, n: int) -> Any:
    with _device(v):
        out = _xp(v).empty_like(v)
        _k.commute(v, m, n, out)
    return out


def commutation_matrix(m: int, n: int, dtype: Any, like: Any) -> Any:
    with _device(like):
        out = _xp(like).empty((m * n, m * n), dtype=dtype)
        _k.commutation_dense(m, n, out)
    return out


def kron_apply(A: Any, B: Any, X: Any) -> Any:
    """vec_r(A X B^T), multiplying in the cheaper order (as the CPU core)."""
    _same_device(A, B, X)
    (p, m), (q, n) = A.shape, B.shape
    with _device(A):
        if p * n * (m + q) <= m * q * (n + p):
            out = (A @ X) @ B.T
        else:
            out = A @ (X @ B.T)
        return _c(out).reshape(-1)


# ---- attention ----------------------------------------------------------------------------------


def _attention_forward(X: Any, W_Q: Any, W_K: Any, W_V: Any):
    c = 1.0 / math.sqrt(W_Q.shape[1])
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    A = _softmax_rows(_c(c * (Q @ K.T)))
    return c, Q, K, V, A, A @ V


def attention(X: Any, W_Q: Any, W_K: Any, W_V: Any) -> Any:
    _same_device(X, W_Q, W_K, W_V)
    with _device(X):
        return _attention_forward(X, W_Q, W_K, W_V)[-1]


def attention_jacobian(X: Any, W_Q: Any, W_K: Any, W_V: Any, wrt: str) -> Any:
    """dF/d(wrt) (L d_v, n_wrt), with the per-token forms of docs/derivation.md §3.3."""
    xp = _xp(X)
    _same_device(X, W_Q, W_K, W_V)
    (L, d), dk, dv = X.shape, W_Q.shape[1], W_V.shape[1]
    with _device(X):
        c, Q, K, V, A, F = _attention_forward(X, W_Q, W_K, W_V)
        if wrt == "W_Q":
            # M_t[a,k] = sum_s A[t,s] V[s,a] (K[s,k] - Kbar_t[k]);  J[t dv + a, b dk + k] = c X[t,b] M_t[a,k]
            M = (A @ _outer(V, K).reshape(L, dv * dk)).reshape(L, dv, dk) - _outer(F, A @ K)
            out = xp.empty((L * dv, d * dk), dtype=X.dtype)
            _k.token_kron(X, _c(M), (d, dk, True), c, out)
        elif wrt == "W_K":
            # N_t[a,b] = sum_s A[t,s] V[s,a] (X[s,b] - Xbar_t[b]);  J[t dv + a, b dk + k] = c q_t[k] N_t[a,b]
            N = (A @ _outer(V, X).reshape(L, dv * d)).reshape(L, dv, d) - _outer(F, A @ X)
            out = xp.empty((L * dv, d * dk), dtype=X.dtype)
            _k.token_kron(_c(Q), _c(N), (d, dk, False), c, out)
        elif wrt == "W_V":
            out = xp.empty((L * dv, d * dv), dtype=X.dtype)
            _k.token_kron(_c(A @ X), None, (d, dv, True), 1.0, out)
        else:
            Qt, Kt = _c(Q @ W_K.T), K @ W_Q.T  # row t: W_K q_t;  row s: W_Q k_s
            D = c * ((A @ _outer(V, Kt).reshape(L, dv * d)).reshape(L, dv, d) - _outer(F, A @ Kt))
            out = xp.empty((L * dv, L * d), dtype=X.dtype)
            _k.attention_dx(A, W_V, _c(V), _c(F), Qt, _c(D), c, out)
    return out


# ---- FFN ----------------------------------------------------------------------------------------


def ffn(Y: Any, W_1: Any, W_2: Any) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    with _device(Y):
        H = Y @ W_1
        return xp.where(H > 0, H, 0).astype(Y.dtype, copy=False) @ W_2


def ffn_jacobian(Y: Any, W_1: Any, W_2: Any, wrt: str, layout: str) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    (L, d), f, e = Y.shape, W_1.shape[1], W_2.shape[1]
    with _device(Y):
        H = Y @ W_1
        mask = (H > 0).astype(Y.dtype)
        if layout == "kron":  # the per-token Kronecker factors (U, V) of ffn.ffn_jacobian
            if wrt == "W_1":
                return Y.copy(), _c(W_2.T[None, :, :] * mask[:, None, :])
            return _c(H * mask), xp.broadcast_to(xp.eye(e, dtype=Y.dtype), (L, e, e))
        if wrt == "W_1":  # J[t e + c, b f + g] = Y[t,b] (W_2^T D_t)[c,g]
            out = xp.empty((L * e, d * f), dtype=Y.dtype)
            _k.token_kron(Y, _c(W_2.T[None, :, :] * mask[:, None, :]), (d, f, True), 1.0, out)
            return out
        if wrt == "W_2":  # relu(H) (x) I_e
            out = xp.empty((L * e, f * e), dtype=Y.dtype)
            _k.token_kron(_c(H * mask), None, (f, e, True), 1.0, out)
            return out
        blocks = _c((W_2.T[None, :, :] * mask[:, None, :]) @ W_1.T)  # (L, e, d): W_2^T D_t W_1^T
        if layout == "blocks":
            return blocks
        out = xp.empty((L * e, L * d), dtype=Y.dtype)
        _k.blockdiag_dense(blocks, out)
    return out


def ffn_cross_hessian(Y: Any, W_1: Any, W_2: Any, layout: str) -> Any:
    xp = _xp(Y)
    _same_device(Y, W_1, W_2)
    (L, d), f, e = Y.shape, W_1.shape[1], W_2.shape[1]
    with _device(Y):
        C = _c(_outer(Y, ((Y @ W_1) > 0).astype(Y.dtype)))  # (L, d, f): Y[t,b] 1[H[t,g] > 0]
        if layout == "blocks":
            return C
        out = xp.empty((L * e * d * f, f * e), dtype=Y.dtype)
        _k.ffn_cross_dense(C, e, out)
    return out


# ---- the block and models: the engine ------------------------------------------------------------
#
# Every block of the family: the engine's forward pass, Jacobians, loss and gradient run on the host
# from copies of the inputs, and their result is copied to X's device; the Hessians assemble on the
# device (block_output_hessian, loss_hessian).


def on_host(X3: Any, compute: Any, *arrays: Any) -> Any:
    """compute(*host copies of arrays): the CPU engine's result, an array returned on X3's device or
    a Python number as it is."""
    result = compute(*(_backend.to_host(a) for a in arrays))
    return _backend.to_device_of(X3, result) if isinstance(result, np.ndarray) else result


def block_output_hessian(X3: Any, spec: tuple, weights: tuple[Any, ...], eps: float, i: int, j: int,
                         shape: tuple[int, int]) -> Any:
    """For each output entry o: the (i, j) block of the Hessian of Z_o (cotangent e_o), by the engine
    (its per-token work on the host from copies of the inputs, each assembly on the GPU)."""
    xp = _xp(X3)
    with _device(X3):
        out = xp.empty(shape, dtype=X3.dtype)
        host = _backend.to_host
        _k.block_output_hessian(host(X3), spec, [host(w) for w in weights], eps, i, j, out)
    return out


def loss_hessian(X3: Any, spec: tuple, weights: tuple[Any, ...], eps: float, kind: int, values: Any, classes: Any,
                 part: int, selected: list[bool], P: int, out: Any, head: tuple[Any, Any]) -> Any:
    """The (P, P) symmetric loss Hessian of any block of the family (``spec``: BlockSpec._core()),
    part 0 full, 1 outer, 2 functional, by the engine: its per-token work runs on the host from
    copies of the (small) inputs, the assembly on the GPU into ``out`` (checked by the caller) or a
    new array. Complete, and checked finite, when this returns."""
    xp = _xp(X3)
    with _device(X3):
        H = xp.empty((P, P), dtype=X3.dtype) if out is None else out
        host = _backend.to_host
        _k.loss_hessian(host(X3), spec, [host(w) for w in weights], eps, kind, host(values), host(classes), part,
                        selected, H, tuple(host(h) for h in head))
    return H
