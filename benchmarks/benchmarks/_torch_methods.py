"""The PyTorch side of the suite: torch imported on first use (limited to THREADS threads) and the
model of blockhess._torch_reference in its fastest formulation (``torch.nn.functional.layer_norm``,
2-5x faster under ``jacrev`` than a hand-written LayerNorm), float64.

Imported lazily so that blockhess-only benchmarks (``peakmem_``) do not pay for PyTorch. A commit
whose blockhess lacks ``_torch_reference`` skips the PyTorch methods (NotImplementedError).
"""

from __future__ import annotations

import numpy as np

from . import _settings

_torch = None


def torch():
    """PyTorch, imported on first use and limited to THREADS threads."""
    global _torch
    if _torch is None:
        try:
            import torch as _t
        except ImportError as err:
            raise NotImplementedError("PyTorch is not installed") from err
        _t.set_num_threads(_settings.THREADS)
        _torch = _t
    return _torch


def reference():
    """blockhess._torch_reference (after torch(), so that the thread limit holds)."""
    torch()
    try:
        from blockhess import _torch_reference
    except ImportError as err:
        raise NotImplementedError(f"blockhess._torch_reference is not available at this commit: {err}") from err
    return _torch_reference


def as_tensor(a: np.ndarray):
    return torch().from_numpy(np.array(a, dtype=np.float64, copy=True))


def layernorm(x):
    return reference().layernorm(x, _settings.EPS, fused=True)


def attention(X, WQ, WK, WV):
    return reference().attention(X, WQ, WK, WV)


def ffn(Y, W1, W2):
    return reference().ffn(Y, W1, W2)


def block_mse_of_flat(X, target, weights):
    """(the MSE loss of the block as a function of the flat weights, those weights), as tensors."""
    ref = reference()
    X, target, weights = ref.as_problem(X, target, weights, "mse", dtype=torch().float64)
    loss = ref.loss_of_flat(X, target, [w.shape for w in weights], "mse", _settings.EPS, fused=True)
    return loss, ref.flatten(weights)
