"""Spectra of a symmetric operator through its products alone: Lanczos tridiagonalisation and the
spectral density by stochastic Lanczos quadrature (SLQ; Ubaru, Chen and Saad 2017; Ghorbani,
Krishnan and Xiao 2019).

For a unit probe v, m Lanczos steps give a tridiagonal T_m = Y diag(theta) Y^T, and the Gauss
quadrature v^T f(H) v ~ sum_k tau_k f(theta_k) with weights tau_k = Y[0, k]^2, exact for every
polynomial f of degree <= 2m - 1. With Rademacher probes (scaled to unit length) the mean over
probes of the discrete measure sum_k tau_k delta(x - theta_k) is an unbiased estimate of the
spectral density (1/P) sum_i delta(x - lambda_i) on polynomials of that degree; it is then
broadened by a Gaussian of width ``sigma`` to be drawn. Each measure has total weight 1, so the
density integrates to 1 over the real line (to within the grid's truncation, reported).

The loops here run over Lanczos steps and probes, each one matrix-vector product of the operator
(the C++ core's exact closed-form H v); vector arithmetic is NumPy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


def lanczos(matvec: Callable[[np.ndarray], np.ndarray], v0: np.ndarray, steps: int,
            progress: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) of the Lanczos tridiagonal of ``matvec`` from the start vector ``v0``, with full
    reorthogonalisation (twice, classical Gram-Schmidt: the basis stays orthogonal to rounding, so
    no spurious copies of converged eigenvalues appear). Stops early on an invariant subspace."""
    P = v0.shape[0]
    steps = min(steps, P)
    basis = np.empty((steps, P), dtype=np.float64)
    alpha, beta = [], []
    q = np.asarray(v0, dtype=np.float64) / np.linalg.norm(v0)
    for j in range(steps):
        basis[j] = q
        w = np.asarray(matvec(q), dtype=np.float64)
        alpha.append(float(q @ w))
        for _ in range(2):
            w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        if progress:
            progress()
        b = float(np.linalg.norm(w))
        if j == steps - 1 or b <= 1e-12 * max(1.0, abs(alpha[-1])):
            break
        beta.append(b)
        q = w / b
    return np.asarray(alpha), np.asarray(beta)


def gauss_quadrature(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes theta, weights tau) of the Lanczos tridiagonal: its eigenvalues and the squared first
    components of its eigenvectors (weights sum to 1)."""
    T = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    theta, Y = np.linalg.eigh(T)
    return theta, Y[0] ** 2


@dataclass
class SpectralDensity:
    """A spectral density estimate: ``density`` on ``grid`` (integrates to 1 up to ``truncation``,
    the weight of the Gaussians outside the grid), and the quadrature it was drawn from: ``nodes``
    and ``weights`` of each probe (rows), ``probes``, ``steps`` and the broadening ``sigma``."""

    grid: np.ndarray
    density: np.ndarray
    nodes: list[np.ndarray]
    weights: list[np.ndarray]
    probes: int
    steps: int
    sigma: float
    truncation: float

    def moment(self, m: int) -> float:
        """The m-th moment of the quadrature measure (before broadening): an unbiased estimate of
        tr(H^m) / P for m <= 2 steps - 1, with the Hutchinson error of ``probes`` probes."""
        return float(np.mean([np.sum(w * t**m) for t, w in zip(self.nodes, self.weights)]))


def spectral_density(matvec: Callable[[np.ndarray], np.ndarray], P: int, *, probes: int = 10, steps: int = 60,
                     sigma: float | None = None, grid: int | np.ndarray = 1000, seed: int = 0,
                     progress: Callable[[], None] | None = None) -> SpectralDensity:
    """Stochastic Lanczos quadrature of the symmetric operator ``matvec`` of size ``P``.

    probes: Rademacher probes; steps: Lanczos steps per probe (at most P); sigma: the Gaussian
    broadening (default: 1% of the spectrum's width); grid: the number of points over the spectrum's
    range widened by 5 sigma on each side, or the points themselves."""
    from ._validate import positive_int

    probes, steps = positive_int(probes, "probes"), positive_int(steps, "steps")
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    for _ in range(probes):
        v = rng.choice((-1.0, 1.0), size=P)
        theta, tau = gauss_quadrature(*lanczos(matvec, v, steps, progress))
        nodes.append(theta)
        weights.append(tau)
    lo = min(float(t.min()) for t in nodes)
    hi = max(float(t.max()) for t in nodes)
    if sigma is None:
        sigma = 0.01 * max(hi - lo, abs(hi), abs(lo), np.finfo(np.float64).tiny)
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if np.ndim(grid) == 0:
        points = positive_int(grid, "grid")
        x = np.linspace(lo - 5 * sigma, hi + 5 * sigma, max(points, 2))
    else:
        x = np.asarray(grid, dtype=np.float64)
        if x.ndim != 1 or x.size < 2 or not np.all(np.diff(x) > 0):
            raise ValueError("grid must be a count or an increasing 1-D array of at least 2 points")
    density = np.zeros_like(x)
    outside = 0.0
    for theta, tau in zip(nodes, weights):
        z = (x[:, None] - theta[None, :]) / sigma
        density += (np.exp(-0.5 * z**2) @ tau) / (sigma * math.sqrt(2 * math.pi))
        inside = 0.5 * (np.vectorize(math.erf)((x[-1] - theta) / (sigma * math.sqrt(2)))
                        - np.vectorize(math.erf)((x[0] - theta) / (sigma * math.sqrt(2))))
        outside += float(tau @ (1 - inside))
    return SpectralDensity(grid=x, density=density / probes, nodes=nodes, weights=weights, probes=probes,
                           steps=steps, sigma=float(sigma), truncation=outside / probes)


def eigsh(operator: Any, k: int, which: str, tol: float, return_eigenvectors: bool):
    """The k eigenvalues of ``which`` ("LA" largest, "SA" smallest algebraic, "LM" largest
    magnitude) of a symmetric operator through scipy's ARPACK Lanczos; ascending, with eigenvectors
    as columns when asked for."""
    from ._validate import choice, positive_int

    which = choice(which, "which", ("LA", "SA", "LM"))
    P = operator.shape[0]
    k = positive_int(k, "k")
    if k >= P:
        raise ValueError(f"k must be smaller than the operator's size {P}, got {k}")
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    try:
        from scipy.sparse.linalg import eigsh as arpack
    except ImportError as err:  # pragma: no cover - scipy is in the test extra
        raise ImportError("eigsh() needs scipy: pip install scipy") from err
    v0 = np.random.default_rng(0).standard_normal(P)  # ARPACK's random start, made reproducible
    result = arpack(operator.to_scipy(), k=k, which=which, tol=tol, v0=v0,
                    return_eigenvectors=return_eigenvectors)
    if not return_eigenvectors:
        return np.sort(result)
    values, vectors = result
    order = np.argsort(values)
    return values[order], vectors[:, order]
