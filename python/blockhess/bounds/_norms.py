"""Exact spectral norms of the loss Hessian's parameter blocks: dense SVD while the (P, P) Hessian is
small, power iteration through the exact Hessian-vector product beyond."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..block import _selected_sizes, loss_hessian
from ..hvp import hessian_operator

DENSE_LIMIT = 4096  # parameters; a (P, P) float64 Hessian of 128 MiB


def block_norms(X: Any, target: Any, params: Any, *, part: str = "full", eps: float | None = None,
                names: tuple[str, ...] | None = None, method: str = "auto", iterations: int = 200,
                **loss_options: Any) -> dict[tuple[str, str], float]:
    """``{(a, b): ||H[a, b]||_2}`` for every pair a <= b (in the parameters' order) of ``names``
    (default: all), and ``("all", "all")`` for the whole Hessian over them."""
    names = tuple(params.names) if names is None else tuple(names)
    sizes = _selected_sizes(params, names)
    P = sum(sizes)
    if method == "auto":
        method = "dense" if P <= DENSE_LIMIT else "power"
    if method == "dense":
        dense = loss_hessian(X, target, params, part=part, eps=eps, wrt=names, **loss_options)
        ends = np.cumsum((0, *sizes))
        where = {n: slice(int(s), int(e)) for n, s, e in zip(names, ends[:-1], ends[1:])}
        out = {(a, b): float(np.linalg.norm(dense[where[a], where[b]], 2)) for i, a in enumerate(names) for b in names[i:]}
        out["all", "all"] = float(np.abs(np.linalg.eigvalsh(dense)).max())
        return out
    if method != "power":
        raise ValueError(f"method must be 'auto', 'dense' or 'power', got {method!r}")
    out = {}
    for i, a in enumerate(names):
        for b in names[i:]:
            pair = (a,) if a == b else (a, b)
            op = hessian_operator(X, target, params, part=part, eps=eps, wrt=pair, **loss_options)
            out[a, b] = _block_norm_by_power(op, sizes[i], a == b, iterations)
    op = hessian_operator(X, target, params, part=part, eps=eps, wrt=names, **loss_options)
    out["all", "all"] = _block_norm_by_power(op, P, True, iterations)
    return out


def _block_norm_by_power(op: Any, n_a: int, diagonal: bool, iterations: int) -> float:
    """The largest singular value of the (a, b) block of an operator over (a, b) (or over a alone):
    power iteration on H_ab^T H_ab, each step two exact products."""
    P = op.shape[0]
    rng = np.random.default_rng(0)
    w = rng.standard_normal(P - n_a if not diagonal else P)
    w /= np.linalg.norm(w)
    sigma = 0.0
    for _ in range(iterations):
        if diagonal:
            y = np.asarray(op.matvec(w))
            z = np.asarray(op.matvec(y))
        else:
            y = np.asarray(op.matvec(np.concatenate([np.zeros(n_a), w])))[:n_a]       # H_ab w
            z = np.asarray(op.matvec(np.concatenate([y, np.zeros(P - n_a)])))[n_a:]  # H_ba y
        norm = float(np.linalg.norm(z))
        if norm == 0.0:
            return 0.0
        new = float(np.sqrt(norm))
        w = z / norm
        if abs(new - sigma) <= 1e-12 * new:
            return new
        sigma = new
    return sigma


def hessian_norm(X: Any, target: Any, params: Any, *, eps: float | None = None, method: str = "auto",
                 iterations: int = 200, **loss_options: Any) -> float:
    """||H||_2 of the whole loss Hessian (dense eigenvalues while small, power iteration beyond)."""
    if method == "auto":
        method = "dense" if params.size <= DENSE_LIMIT else "power"
    if method == "dense":
        return float(np.abs(np.linalg.eigvalsh(loss_hessian(X, target, params, eps=eps, **loss_options))).max())
    return _block_norm_by_power(hessian_operator(X, target, params, eps=eps, **loss_options), params.size, True,
                                iterations)
