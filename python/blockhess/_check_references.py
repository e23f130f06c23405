"""The references that ``blockhess check`` verifies the closed-form Hessian against, independent of
blockhess's formulas: ``torch.func.hessian`` of the block written in PyTorch (float64), or central
finite differences of the exact closed-form gradient."""

from __future__ import annotations

import time

import numpy as np

from ._check_config import Config
from .block import BlockParams, loss_gradient


# Steps of the finite-difference reference, by dtype.
FD_STEP = {"float64": 1e-5, "float32": 1e-2}


def resolve_reference(name: str) -> str:
    """"auto": torch when it can be imported, else finite differences."""
    if name != "auto":
        return name
    try:
        import torch  # noqa: F401
    except ImportError:
        return "finite-differences"
    return "torch"


def torch_reference(X, target, weights, cfg: Config, progress=None, head=None):
    """torch.func.hessian of the loss of the block written directly in PyTorch, float64 (the
    paper's block as the paper writes it; any other spec from the family's definition)."""
    import torch

    from . import _torch_reference as reference

    X, target, weights = reference.as_problem(X, target, weights, cfg.loss, dtype=torch.float64)
    shapes = [tuple(w.shape) for w in weights]
    if head is not None:
        head = tuple(torch.as_tensor(a, dtype=torch.float64) for a in head)
    if cfg.spec.is_paper_block:
        loss_of = reference.loss_of_flat(X, target, shapes, cfg.loss, cfg.eps, head=head)
    else:
        names = [name for name, _ in cfg.parameters()]
        output_of = reference.family_of_flat(X, cfg.spec, names, shapes, cfg.eps)
        loss_of = lambda v: reference.loss(output_of(v), target, cfg.loss, head)  # noqa: E731
    v0 = reference.flatten(weights)
    hess = torch.func.hessian(loss_of)
    hess(v0)  # warm-up
    if progress:
        progress.advance()
    t0 = time.perf_counter()
    H = hess(v0)
    elapsed = time.perf_counter() - t0
    if progress:
        progress.advance()
    return H.numpy(), elapsed


def finite_difference_reference(X, target, params: BlockParams, cfg: Config, progress=None, head=None):
    """Central differences of the exact gradient, one parameter at a time."""
    v0 = np.asarray(params.flatten(), dtype=np.float64)
    P = v0.size
    h = FD_STEP[cfg.dtype]
    cols = np.empty((P, P))
    t0 = time.perf_counter()
    for k in range(P):
        e = np.zeros(P)
        e[k] = h
        plus = BlockParams.unflatten((v0 + e).astype(cfg.dtype), params)
        minus = BlockParams.unflatten((v0 - e).astype(cfg.dtype), params)
        g_plus = loss_gradient(X, target, plus, loss=cfg.loss, eps=cfg.eps, head=head)
        g_minus = loss_gradient(X, target, minus, loss=cfg.loss, eps=cfg.eps, head=head)
        cols[:, k] = (g_plus - g_minus) / (2 * h)
        if progress:
            progress.advance()
    _symmetrise_in_place(cols)
    return cols, time.perf_counter() - t0


def _symmetrise_in_place(A: np.ndarray, tile: int = 512) -> None:
    """A <- (A + A^T) / 2 tile by tile, without a second (P, P) array."""
    n = A.shape[0]
    for i in range(0, n, tile):
        for j in range(i, n, tile):
            upper = A[i:i + tile, j:j + tile]
            mean = 0.5 * (upper + A[j:j + tile, i:i + tile].T)
            A[i:i + tile, j:j + tile] = mean
            A[j:j + tile, i:i + tile] = mean.T
