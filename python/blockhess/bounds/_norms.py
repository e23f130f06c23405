"""Exact spectral norms of the loss Hessian's parameter blocks: dense SVD while the (P, P) Hessian is
small, power iteration through the exact Hessian-vector product beyond."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._validate import choice, nonneg_scalar, positive_int
from ..block import _check_params, _selected_sizes, _selection, loss_hessian
from ..hvp import hessian_operator

DENSE_LIMIT = 4096  # parameters; a (P, P) float64 Hessian of 128 MiB
ITERATIONS = 200    # power iteration's default cap on steps
TOL = 1e-12         # and its default relative change at which it stops


def block_norms(X: Any, target: Any, params: Any, *, part: str = "full", eps: float | None = None,
                names: tuple[str, ...] | None = None, method: str = "auto", iterations: int = ITERATIONS,
                tol: float = TOL, **loss_options: Any) -> dict[tuple[str, str], float]:
    """``{(a, b): ||H[a, b]||_2}`` for every pair a <= b of ``names`` (default: all), keyed in the
    parameters' order whatever the order of ``names`` (``("W_Q", "W_V")``, never ``("W_V", "W_Q")``),
    and ``("all", "all")`` for the whole Hessian over them.

    ``method``: "dense" (the dense Hessian's singular values), "power" (power iteration through exact
    Hessian-vector products, until the estimate changes by at most ``tol`` relative in one step,
    ValueError after ``iterations`` steps without that, saying how many to give) or "auto" (dense
    up to DENSE_LIMIT parameters)."""
    params = _check_params(params)
    names = _selection(params, names, "names")[0]  # canonical, as the Hessian's rows and columns
    sizes = _selected_sizes(params, names)
    method, iterations, tol = _norm_options(method, iterations, tol, sum(sizes))
    if method == "dense":
        dense = loss_hessian(X, target, params, part=part, eps=eps, wrt=names, **loss_options)
        ends = np.cumsum((0, *sizes))
        where = {n: slice(int(s), int(e)) for n, s, e in zip(names, ends[:-1], ends[1:])}
        out = {(a, b): float(np.linalg.norm(dense[where[a], where[b]], 2)) for i, a in enumerate(names) for b in names[i:]}
        out["all", "all"] = float(np.abs(np.linalg.eigvalsh(dense)).max())
        return out
    out = {}
    for i, a in enumerate(names):
        for b in names[i:]:
            pair = (a,) if a == b else (a, b)
            op = hessian_operator(X, target, params, part=part, eps=eps, wrt=pair, **loss_options)
            out[a, b] = _block_norm_by_power(op, sizes[i], a == b, iterations, tol, f"the ({a}, {b}) block")
    op = hessian_operator(X, target, params, part=part, eps=eps, wrt=names, **loss_options)
    out["all", "all"] = _block_norm_by_power(op, op.shape[0], True, iterations, tol, "the whole Hessian")
    return out


def _norm_options(method: Any, iterations: Any, tol: Any, P: int) -> tuple[str, int, float]:
    """(method with "auto" resolved for P parameters, iterations, tol), checked."""
    method = choice(method, "method", ("auto", "dense", "power"))
    iterations, tol = positive_int(iterations, "iterations"), nonneg_scalar(tol, "tol")
    if method == "auto":
        method = "dense" if P <= DENSE_LIMIT else "power"
    return method, iterations, tol


def _block_norm_by_power(op: Any, n_a: int, diagonal: bool, iterations: int, tol: float, what: str) -> float:
    """The largest singular value of the (a, b) block of an operator over (a, b) (or over a alone):
    power iteration on H_ab^T H_ab, each step two exact products. ValueError naming ``what`` when
    the estimate has not settled to ``tol`` within ``iterations`` steps."""
    P = op.shape[0]
    rng = np.random.default_rng(0)
    w = rng.standard_normal(P - n_a if not diagonal else P)
    w /= np.linalg.norm(w)
    sigma, change, previous_change = 0.0, math.inf, math.inf
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
        new = math.sqrt(norm)
        w = z / norm
        previous_change, change = change, abs(new - sigma) / new
        if change <= tol:
            return new
        sigma = new
    raise ValueError(f"power iteration for the norm of {what} has not converged in iterations={iterations} "
                     f"(its last step changed the estimate {sigma:.6g} by {change:.2g} relative, more than "
                     f"tol={tol:g}); pass iterations={_iterations_needed(iterations, tol, change, previous_change)} "
                     "or a larger tol, or method='dense' while the dense Hessian fits")


def _iterations_needed(iterations: int, tol: float, change: float, previous_change: float) -> int:
    """A step count that should reach ``tol``: power iteration's change shrinks by a steady factor
    per step (the squared ratio of the two largest singular values), here change / previous_change."""
    rate = change / previous_change
    if not 0 < rate < 1 or tol == 0:
        return 10 * iterations
    return iterations + 2 * math.ceil(math.log(tol / change) / math.log(rate))


def hessian_norm(X: Any, target: Any, params: Any, *, eps: float | None = None, method: str = "auto",
                 iterations: int = ITERATIONS, tol: float = TOL, **loss_options: Any) -> float:
    """||H||_2 of the whole loss Hessian (dense eigenvalues while small, power iteration beyond;
    options as in :func:`block_norms`)."""
    params = _check_params(params)
    method, iterations, tol = _norm_options(method, iterations, tol, params.size)
    if method == "dense":
        return float(np.abs(np.linalg.eigvalsh(loss_hessian(X, target, params, eps=eps, **loss_options))).max())
    return _block_norm_by_power(hessian_operator(X, target, params, eps=eps, **loss_options), params.size, True,
                                iterations, tol, "the whole Hessian")
