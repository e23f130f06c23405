"""Array-level wrappers around the ``_cuda`` launchers (private).

Each function takes CuPy arrays that already have the right dtype, shape and C-contiguous layout
(the callers in :mod:`blockhess._gpu` allocate them), checks that, and enqueues one kernel on
CuPy's current stream of the current device. Nothing is copied and nothing synchronises.

The tests swap this module for a NumPy emulation with the same functions, which runs the
orchestration in :mod:`blockhess._gpu` on machines without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend

_SUFFIX = {np.dtype(np.float32): "_f32", np.dtype(np.float64): "_f64"}



def _stream() -> int:
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


def _fn(name: str, dtype: Any):
    return getattr(_backend._cuda, name + _SUFFIX[np.dtype(dtype)])


def _ptr(a: Any) -> int:
    return 0 if a is None else int(a.data.ptr)


def _check(dtype: np.dtype, *pairs: tuple[Any, tuple[int, ...] | None]) -> None:
    """Every array (None allowed) has ``dtype``, is C-contiguous and has the given shape."""
    for a, shape in pairs:
        if a is None:
            continue
        if np.dtype(a.dtype) != dtype or not a.flags.c_contiguous or (shape is not None and tuple(a.shape) != shape):
            raise RuntimeError(
                f"blockhess internal error: kernel argument {a.dtype} {tuple(a.shape)} "
                f"(C-contiguous: {a.flags.c_contiguous}) where {dtype} {shape} was expected"
            )


# ---- LayerNorm ----------------------------------------------------------------------------------

def ln_forward(X, eps, gamma, beta, Z, sigma) -> None:
    L, d = X.shape
    _check(X.dtype, (X, None), (gamma, (d,)), (beta, (d,)), (Z, (L, d)), (sigma, (L,)))
    _fn("layernorm_forward", X.dtype)(_ptr(X), L, d, float(eps), _ptr(gamma), _ptr(beta), _ptr(Z), _ptr(sigma), _stream())


def ln_slab(X, eps, gamma, kind: int, out, sigma, tile_elems: int = 0) -> None:
    """kind 0: Jacobian blocks, 1: dZ/dgamma, 2: dZ/dbeta; out (L, d, d)."""
    L, d = X.shape
    _check(X.dtype, (X, None), (gamma, (d,)), (out, (L, d, d)), (sigma, (L,)))
    _fn("layernorm_jacobian_blocks", X.dtype)(
        _ptr(X), L, d, float(eps), _ptr(gamma), int(kind), _ptr(out), _ptr(sigma), _stream(), int(tile_elems)
    )


def ln_jacobian_dense(X, eps, gamma, out, sigma) -> None:
    L, d = X.shape
    _check(X.dtype, (X, None), (gamma, (d,)), (out, (L * d, L * d)), (sigma, (L,)))
    _fn("layernorm_jacobian_dense", X.dtype)(_ptr(X), L, d, float(eps), _ptr(gamma), _ptr(out), _ptr(sigma), _stream())


def ln_hessian_blocks(X, eps, gamma, out, sigma) -> None:
    L, d = X.shape
    _check(X.dtype, (X, None), (gamma, (d,)), (out, (L, d, d, d)), (sigma, (L,)))
    _fn("layernorm_hessian_blocks", X.dtype)(_ptr(X), L, d, float(eps), _ptr(gamma), _ptr(out), _ptr(sigma), _stream())


def ln_hessian_dense(X, eps, gamma, out, sigma) -> None:
    L, d = X.shape
    n = L * d
    _check(X.dtype, (X, None), (gamma, (d,)), (out, (n * n, n)), (sigma, (L,)))
    _fn("layernorm_hessian_dense", X.dtype)(_ptr(X), L, d, float(eps), _ptr(gamma), _ptr(out), _ptr(sigma), _stream())


def ln_hessian_contract(X, eps, gamma, G, out, sigma) -> None:
    L, d = X.shape
    _check(X.dtype, (X, None), (gamma, (d,)), (G, (L, d)), (out, (L, d, d)), (sigma, (L,)))
    _fn("layernorm_hessian_contract", X.dtype)(
        _ptr(X), L, d, float(eps), _ptr(gamma), _ptr(G), _ptr(out), _ptr(sigma), _stream()
    )


# ---- softmax ------------------------------------------------------------------------------------

def softmax_forward(T, A) -> None:
    m, n = T.shape
    _check(T.dtype, (T, None), (A, (m, n)))
    _fn("softmax_forward", T.dtype)(_ptr(T), m, n, _ptr(A), _stream())


def _softmax_derivative(name: str, A, out, shape) -> None:
    m, n = A.shape
    _check(A.dtype, (A, None), (out, shape))
    _fn(name, A.dtype)(_ptr(A), m, n, _ptr(out), _stream())


def softmax_jacobian_blocks(A, out) -> None:
    m, n = A.shape
    _softmax_derivative("softmax_jacobian_blocks", A, out, (m, n, n))


def softmax_jacobian_dense(A, out) -> None:
    m, n = A.shape
    _softmax_derivative("softmax_jacobian_dense", A, out, (m * n, m * n))


def softmax_hessian_blocks(A, out) -> None:
    m, n = A.shape
    _softmax_derivative("softmax_hessian_blocks", A, out, (m, n, n, n))


def softmax_hessian_dense(A, out) -> None:
    m, n = A.shape
    _softmax_derivative("softmax_hessian_dense", A, out, ((m * n) ** 2, m * n))


def softmax_hessian_contract(A, G, out) -> None:
    m, n = A.shape
    _check(A.dtype, (A, None), (G, (m, n)), (out, (m, n, n)))
    _fn("softmax_hessian_contract", A.dtype)(_ptr(A), _ptr(G), m, n, _ptr(out), _stream())


def softmax_vjp(A, G, out) -> None:
    m, n = A.shape
    _check(A.dtype, (A, None), (G, (m, n)), (out, (m, n)))
    _fn("softmax_vjp", A.dtype)(_ptr(A), _ptr(G), m, n, _ptr(out), _stream())


# ---- structured assembly ------------------------------------------------------------------------

def commute(v, m: int, n: int, out) -> None:
    """out = K_{m,n} v for v of shape (m n,) or (m n, cols)."""
    cols = 1 if v.ndim == 1 else int(v.shape[1])
    _check(v.dtype, (v, (m * n,) if v.ndim == 1 else (m * n, cols)), (out, tuple(v.shape)))
    _fn("commute", v.dtype)(_ptr(v), m, n, cols, _ptr(out), _stream())


def commutation_dense(m: int, n: int, out) -> None:
    _check(out.dtype, (out, (m * n, m * n)))
    _fn("commutation_dense", out.dtype)(m, n, _ptr(out), _stream())


def synchronize() -> None:
    _backend._cuda.synchronize(_stream())


# ---- the engine -----------------------------------------------------------------------------------

def loss_hessian(X3, spec, weights, eps, kind, values, classes, part, selected, H, head) -> None:
    """The engine's loss Hessian of a block into the device array H (P, P); the other arguments are
    host arrays, as _core.loss_hessian takes them. Synchronises (it reads the finiteness flag back)."""
    P = H.shape[0]
    _check(H.dtype, (H, (P, P)))
    _fn("loss_hessian", H.dtype)(X3, spec, list(weights), float(eps), kind, values, classes, part, list(selected),
                                 _ptr(H), P, _stream(), *head)


def block_output_hessian(X3, spec, weights, eps, i, j, out) -> None:
    """The engine's d2 Z / dW_i dW_j of one sample into the device array out; host inputs."""
    _check(out.dtype, (out, None))
    _fn("block_output_hessian", out.dtype)(X3, spec, list(weights), float(eps), i, j, _ptr(out), _stream())


# ---- the engine on the GPU backend: device arrays in, device arrays out ------------------------


def _device_arg(a: Any) -> tuple[int, tuple[int, ...]] | None:
    """A device array as _cuda's engine bindings take it: its pointer and shape (C-contiguous)."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise RuntimeError(f"blockhess internal error: a non-contiguous {a.dtype} {tuple(a.shape)} for the engine")
    return _ptr(a), tuple(int(n) for n in a.shape)


def attention_forward(X, W_Q, W_K, W_V, out) -> None:
    """softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V into the device array out, on the GPU backend; done
    (and checked finite) when this returns."""
    _fn("attention_forward", out.dtype)(*map(_device_arg, (X, W_Q, W_K, W_V, out)), _stream())


def attention_jacobian(X, W_Q, W_K, W_V, wrt: int, out) -> None:
    """The attention's Jacobian with respect to ``wrt`` (src/sublayer_shapes.hpp) into out, on the GPU backend."""
    _fn("attention_jacobian", out.dtype)(*map(_device_arg, (X, W_Q, W_K, W_V)), wrt, _device_arg(out), _stream())


def ffn_forward(Y, W_1, W_2, out) -> None:
    """relu(Y W_1) W_2 into the device array out, on the GPU backend; done (and checked finite) when
    this returns."""
    _fn("ffn_forward", out.dtype)(*map(_device_arg, (Y, W_1, W_2, out)), _stream())


def ffn_jacobian(Y, W_1, W_2, kind: int, out) -> None:
    """The FFN's Jacobian or Kronecker factor of ``kind`` (src/sublayer_shapes.hpp) into out, on the GPU backend."""
    _fn("ffn_jacobian", out.dtype)(*map(_device_arg, (Y, W_1, W_2)), kind, _device_arg(out), _stream())


def ffn_cross_hessian(Y, W_1, W_2, kind: int, out) -> None:
    """The FFN's (W_1, W_2) second derivative, blocks (0) or dense (1), into out, on the GPU backend."""
    _fn("ffn_cross_hessian", out.dtype)(*map(_device_arg, (Y, W_1, W_2)), kind, _device_arg(out), _stream())


def engine_block_forward(X3, spec, weights, eps, out) -> None:
    """The output Z of a block or model into the device array out (B, L, width), on the GPU backend,
    queued on the current stream; every argument a device array (or a code)."""
    _check(out.dtype, (out, None))
    _fn("block_forward", out.dtype)(_device_arg(X3), spec, [_device_arg(w) for w in weights], float(eps), _ptr(out),
                                    _stream())


def engine_block_jacobian(X3, spec, weights, eps, p, out) -> None:
    """dZ/dW_p of one sample into the device array out, on the GPU backend (from the factors, or a
    forward tangent per entry where they do not reach p), queued on the current stream; every
    argument a device array (or a code)."""
    _check(out.dtype, (out, None))
    _fn("block_jacobian", out.dtype)(_device_arg(X3), spec, [_device_arg(w) for w in weights], float(eps), p,
                                     _ptr(out), _stream())


def engine_loss_gradient(X3, spec, weights, eps, kind, values, classes, head, grad) -> float:
    """The loss of a block or model and its gradient into the device array grad (P,) (None: the loss
    alone), on the GPU backend; every argument a device array (or a code; head (W_C, b_C) or
    (None, None)). Returns the loss (read back)."""
    _check(weights[0].dtype, (grad, None))
    return float(_fn("loss_gradient", weights[0].dtype)(_device_arg(X3), spec, [_device_arg(w) for w in weights],
                                                        float(eps), kind, _device_arg(values), _device_arg(classes),
                                                        *map(_device_arg, head), _ptr(grad), _stream()))


def engine_loss_hvp(X3, spec, weights, eps, kind, values, classes, head, part, selected, V_rows, out_rows) -> None:
    """H V on the GPU backend, V and out (k, P): one product a row, queued on the current stream."""
    k, P = V_rows.shape
    _check(out_rows.dtype, (V_rows, (k, P)), (out_rows, (k, P)))
    _fn("loss_hvp", out_rows.dtype)(_device_arg(X3), spec, [_device_arg(w) for w in weights], float(eps), kind,
                                    _device_arg(values), _device_arg(classes), *map(_device_arg, head), part,
                                    list(selected), _ptr(V_rows), k, _ptr(out_rows), _stream())


def engine_hessian_operator(X3, spec, weights, eps, kind, values, classes, head, part, selected) -> Any:
    """The loss Hessian as an operator on the GPU backend (_cuda's HessianOperator): its passes run
    now, on the current stream, from copies of X and the weights it keeps in device memory."""
    return _fn("HessianOperator", weights[0].dtype)(_device_arg(X3), spec, [_device_arg(w) for w in weights],
                                                    float(eps), kind, _device_arg(values), _device_arg(classes),
                                                    *map(_device_arg, head), part, list(selected), _stream())


def engine_operator_apply(op, V_rows, out_rows) -> None:
    """out (k, P) = H V for V (k, P) by a _cuda HessianOperator, queued on its stream; a caller on
    another stream is waited for first, and the products before returning."""
    k, P = V_rows.shape
    _check(out_rows.dtype, (V_rows, (k, P)), (out_rows, (k, P)))
    stream = _stream()
    if stream != op.stream:
        _backend._cuda.synchronize(stream)
    op.apply(_ptr(V_rows), k, _ptr(out_rows))
    if stream != op.stream:
        _backend._cuda.synchronize(op.stream)
