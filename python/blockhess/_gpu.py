"""The GPU functions of the public API (private): the names and signatures of ``_core``'s.

Each function here takes what the ``_core`` binding of the same name takes (validated, contiguous
arrays of one dtype, integer codes) and writes its result into ``out``, a GPU (CuPy) array the
caller allocated; :func:`blockhess._backend.kernels_for` picks this module or ``_core``, so a
public function is written once for both. Each runs on the device of ``out`` and on CuPy's current
stream, and checks its result finite as the core does (NonFiniteError naming the same stage).

The block's and its family's results are the engine's: its Hessians (loss_hessian,
block_output_hessian) run their per-token work on the host from copies of the (small) inputs and the
(P, P) assembly on the GPU (_cuda's bindings, cuda/'s DeviceHessian); its forward pass, loss,
gradient, Hessian-vector products and Jacobians run on the GPU backend (_gpu_launch's engine_*
calls), and so do
the attention's and the FFN's functions (_cuda's attention_* and ffn_* bindings: the engine's
factors on the GPU backend). The other component functions are written here over CuPy: per-token,
structured steps go to the blockhess kernels (through :mod:`blockhess._gpu_launch`), dense matrix
products to cuBLAS through CuPy. Nothing here synchronises, except the checks that must raise in
Python: the zero-variance test of LayerNorm rows (one reduction) and the results' finiteness (the
engine's bindings read theirs back).

The code only uses array operations that NumPy and CuPy share, so the tests run it on NumPy arrays
with the real kernels and bindings compiled for the CPU (tests/kernel_emulation.py) on machines
without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend
from . import _gpu_launch as _k
from ._validate import require_finite

# ---- helpers ------------------------------------------------------------------------------------


_xp, _device = _backend.array_module, _backend.device_of


def _same_device(*arrays: Any) -> None:
    ids = {a.device.id for a in arrays if a is not None and not isinstance(a, np.ndarray)}
    if len(ids) > 1:
        raise ValueError(f"inputs live on different GPUs (devices {sorted(ids)}); move them to one device first")


def _check_sigma(sigma: Any) -> None:
    """The CPU core's zero-variance error, from the row standard deviations the kernels wrote."""
    positive = sigma > 0
    if not bool(positive.all()):
        row = int(_xp(sigma).flatnonzero(~positive)[0])
        raise ValueError(
            f"layernorm: row {row} has zero variance (it is constant up to rounding at its scale); "
            "pass eps > 0 to make LayerNorm differentiable there"
        )


# ---- LayerNorm (kinds as src/bind_layernorm.cpp) --------------------------------------------------


def layernorm_forward(X: Any, eps: float, gamma: Any, beta: Any, out: Any) -> None:
    _same_device(X, gamma, beta, out)
    with _device(out):
        sigma = _xp(X).empty(X.shape[0], dtype=X.dtype)
        _k.ln_forward(X, eps, gamma, beta, out, sigma)
        _check_sigma(sigma)
    require_finite(out, "LN(X)")


_LN_JACOBIAN = ("the LayerNorm Jacobian blocks", "the dense LayerNorm Jacobian",
                "the LayerNorm Jacobian with respect to gamma", "the LayerNorm Jacobian with respect to beta")


def layernorm_jacobian(X: Any, eps: float, gamma: Any, kind: int, out: Any) -> None:
    """kind 0: blocks (L, d, d), 1: dense (L d, L d), 2: gamma (L d, d), 3: beta (L d, d)."""
    _same_device(X, gamma, out)
    L, d = X.shape
    with _device(out):
        sigma = _xp(X).empty(L, dtype=X.dtype)
        if kind == 1:
            _k.ln_jacobian_dense(X, eps, gamma, out, sigma)
        else:  # the slab kernel's kinds: 0 blocks, 1 gamma, 2 beta, each (L, d, d)
            _k.ln_slab(X, eps, gamma, 0 if kind == 0 else kind - 1, out.reshape(L, d, d), sigma)
        _check_sigma(sigma)
    require_finite(out, _LN_JACOBIAN[kind])


def layernorm_hessian(X: Any, eps: float, gamma: Any, kind: int, out: Any) -> None:
    """kind 0: blocks (L, d, d, d), 1: dense ((L d)^2, L d)."""
    _same_device(X, gamma, out)
    with _device(out):
        sigma = _xp(X).empty(X.shape[0], dtype=X.dtype)
        (_k.ln_hessian_dense if kind == 1 else _k.ln_hessian_blocks)(X, eps, gamma, out, sigma)
        _check_sigma(sigma)
    require_finite(out, "the dense LayerNorm second derivative" if kind == 1 else "the LayerNorm second-derivative blocks")


def layernorm_hessian_contract(X: Any, eps: float, gamma: Any, G: Any, out: Any) -> None:
    _same_device(X, G, gamma, out)
    with _device(out):
        sigma = _xp(X).empty(X.shape[0], dtype=X.dtype)
        _k.ln_hessian_contract(X, eps, gamma, G, out, sigma)
        _check_sigma(sigma)
    require_finite(out, "the contracted LayerNorm second derivative")


# ---- softmax (kind 0: blocks, 1: dense) ------------------------------------------------------------


def _softmax_rows(T: Any) -> Any:
    A = _xp(T).empty_like(T)
    _k.softmax_forward(T, A)
    return A


def softmax_forward(T: Any, out: Any) -> None:
    with _device(out):
        _k.softmax_forward(T, out)


def softmax_jacobian(T: Any, kind: int, out: Any) -> None:
    with _device(out):
        (_k.softmax_jacobian_dense if kind == 1 else _k.softmax_jacobian_blocks)(_softmax_rows(T), out)


def softmax_hessian(T: Any, kind: int, out: Any) -> None:
    with _device(out):
        (_k.softmax_hessian_dense if kind == 1 else _k.softmax_hessian_blocks)(_softmax_rows(T), out)


# ---- commutation / Kronecker --------------------------------------------------------------------


def commute(v: Any, m: int, n: int, out: Any) -> None:
    with _device(out):
        _k.commute(v, m, n, out)


def commutation_dense(m: int, n: int, out: Any) -> None:
    with _device(out):
        _k.commutation_dense(m, n, out)


def kron_apply(A: Any, B: Any, X: Any, out: Any) -> None:
    """vec_r(A X B^T), multiplying in the cheaper order (as the CPU core); the caller checks it finite."""
    _same_device(A, B, X, out)
    (p, m), (q, n) = A.shape, B.shape
    with _device(out):
        out.reshape(p, q)[...] = (A @ X) @ B.T if p * n * (m + q) <= m * q * (n + p) else A @ (X @ B.T)


# ---- attention (wrt codes as src/sublayer_shapes.hpp): the engine on the GPU backend --------------


def attention_forward(X: Any, W_Q: Any, W_K: Any, W_V: Any, out: Any) -> None:
    _same_device(X, W_Q, W_K, W_V, out)
    with _device(out):
        _k.attention_forward(X, W_Q, W_K, W_V, out)  # checked finite


def attention_jacobian(X: Any, W_Q: Any, W_K: Any, W_V: Any, wrt: int, out: Any) -> None:
    """dF/d(wrt) (L d_v, n_wrt): the engine's factors (W_Q, W_K, W_V) or its closed form (X)."""
    _same_device(X, W_Q, W_K, W_V, out)
    with _device(out):
        _k.attention_jacobian(X, W_Q, W_K, W_V, wrt, out)  # checked finite


# ---- FFN (kinds as src/sublayer_shapes.hpp): the engine on the GPU backend ----------------------------


def ffn_forward(Y: Any, W_1: Any, W_2: Any, out: Any) -> None:
    _same_device(Y, W_1, W_2, out)
    with _device(out):
        _k.ffn_forward(Y, W_1, W_2, out)  # checked finite


def ffn_jacobian(Y: Any, W_1: Any, W_2: Any, kind: int, out: Any) -> None:
    """kind 0: W_1, 1: W_2, 2: Y dense, 3: Y blocks (L, e, d), 4: W_1's factor W_2^T D_t (L, e, f),
    5: W_2's factor relu(Y W_1) (L, f)."""
    _same_device(Y, W_1, W_2, out)
    with _device(out):
        _k.ffn_jacobian(Y, W_1, W_2, kind, out)  # checked finite


def ffn_cross_hessian(Y: Any, W_1: Any, W_2: Any, kind: int, out: Any) -> None:
    """kind 0: blocks (L, d, f), 1: dense ((L e d f), f e)."""
    _same_device(Y, W_1, W_2, out)
    with _device(out):
        _k.ffn_cross_hessian(Y, W_1, W_2, kind, out)  # checked finite


# ---- the block and models: the engine ------------------------------------------------------------
#
# Every block of the family: the engine's Hessians run their per-token work on the host from copies
# of the inputs and assemble on the device (block_output_hessian, loss_hessian); the rest of the
# engine's calls are in _gpu_launch (engine_*).


def block_output_hessian(X3: Any, spec: tuple, weights: list[Any], eps: float, i: int, j: int, out: Any) -> None:
    """For each output entry o: the (i, j) block of the Hessian of Z_o (cotangent e_o), by the engine
    (its per-token work on the host from copies of the inputs, each assembly on the GPU)."""
    host = _backend.to_host
    with _device(out):
        _k.block_output_hessian(host(X3), spec, [host(w) for w in weights], eps, i, j, out)


def loss_hessian(X3: Any, spec: tuple, weights: list[Any], eps: float, kind: int, values: Any, classes: Any,
                 part: int, selected: list[bool], out: Any, W_C: Any, b_C: Any) -> None:
    """The (P, P) symmetric loss Hessian of any block of the family (``spec``: BlockSpec._core()),
    part 0 full, 1 outer, 2 functional, by the engine: its per-token work runs on the host from
    copies of the (small) inputs, the assembly on the GPU into ``out``. Complete, and checked
    finite, when this returns."""
    host = _backend.to_host
    with _device(out):
        _k.loss_hessian(host(X3), spec, [host(w) for w in weights], eps, kind, host(values), host(classes), part,
                        selected, out, (host(W_C), host(b_C)))
