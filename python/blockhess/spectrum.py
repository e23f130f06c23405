"""Spectra of a symmetric operator through its products alone: Lanczos tridiagonalisation and the
spectral density by stochastic Lanczos quadrature (SLQ; Ubaru, Chen and Saad 2017; Ghorbani,
Krishnan and Xiao 2019), and its extreme eigenvalues (:func:`eigsh`).

For a unit probe v, m Lanczos steps give a tridiagonal T_m = Y diag(theta) Y^T, and the Gauss
quadrature v^T f(H) v ~ sum_k tau_k f(theta_k) with weights tau_k = Y[0, k]^2, exact for every
polynomial f of degree <= 2m - 1. With Rademacher probes (scaled to unit length) the mean over
probes of the discrete measure sum_k tau_k delta(x - theta_k) is an unbiased estimate of the
spectral density (1/P) sum_i delta(x - lambda_i) on polynomials of that degree; it is then
broadened by a Gaussian of width ``sigma`` to be drawn. Each measure has total weight 1, so the
density integrates to 1 over the real line (to within the grid's truncation, reported).

Nothing here depends on the operator's scale: Lanczos stops on an invariant subspace relative to
the largest product so far, so H and 1e-20 H give the same nodes (scaled) and weights.

The loops here run over Lanczos steps and probes, each one matrix-vector product of the operator
(the C++ core's exact closed-form H v); vector arithmetic is NumPy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ._config import get_memory_budget
from ._validate import choice, float_array, nonneg_scalar, positive_int, require_output_fits

# Lanczos has reached an invariant subspace when what is left of H q after reorthogonalisation is
# rounding: below this fraction of the largest ||H q|| so far (a lower bound on ||H||).
_BREAKDOWN = 1e-12

# eigsh forms the dense matrix (P products with the identity) and diagonalises it exactly up to this
# size: no more products than ARPACK's Krylov basis of min(P, max(2k + 1, 20)) vectors and its restarts.
# Beyond it too when that basis would span the whole space (2k + 1 >= P): the dense matrix then takes
# no more memory, and ARPACK can stop there ("starting vector is zero", seen at P = 2 in float32).
_DENSE_UP_TO = 100

_FLOAT64 = np.dtype(np.float64)

# The smallest sigma whose Gaussian peak 1 / (sigma sqrt(2 pi)) is finite with room to spare.
_SMALLEST_SIGMA = float(np.finfo(np.float64).tiny)


def _require_basis_fits(steps: int, P: int) -> None:
    require_output_fits((steps, P), _FLOAT64, f"the Lanczos basis of {steps} steps (P = {P})", "take fewer steps")


def lanczos(matvec: Callable[[np.ndarray], np.ndarray], v0: np.ndarray, steps: int,
            progress: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) of the Lanczos tridiagonal of ``matvec`` from the start vector ``v0``, with full
    reorthogonalisation (twice, classical Gram-Schmidt: the basis stays orthogonal to rounding, so
    no spurious copies of converged eigenvalues appear). Stops early on an invariant subspace."""
    v0 = float_array(v0, "v0", ndim=1)
    P = v0.shape[0]
    steps = min(positive_int(steps, "steps"), P)
    start = float(np.linalg.norm(v0))
    if start == 0:
        raise ValueError("v0 must be a nonzero vector")
    _require_basis_fits(steps, P)
    basis = np.empty((steps, P), dtype=np.float64)
    alpha, beta = [], []
    q = np.asarray(v0, dtype=np.float64) / start
    scale = 0.0  # the largest ||H q|| so far
    for j in range(steps):
        basis[j] = q
        w = np.asarray(matvec(q), dtype=np.float64)
        scale = max(scale, float(np.linalg.norm(w)))
        alpha.append(float(q @ w))
        for _ in range(2):
            w -= basis[: j + 1].T @ (basis[: j + 1] @ w)
        if progress:
            progress()
        b = float(np.linalg.norm(w))
        if j == steps - 1 or b <= _BREAKDOWN * scale:  # the zero operator: scale = b = 0, one node at 0
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


def _sigma(sigma: Any) -> float | None:
    """sigma (a real number, numpy's too) as a float, checked; None stays None (the default)."""
    if sigma is None:
        return None
    sigma = nonneg_scalar(sigma, "sigma")
    if sigma < _SMALLEST_SIGMA:
        raise ValueError(f"sigma must be at least {_SMALLEST_SIGMA:.3g} (the Gaussian's peak must be finite), "
                         f"got {sigma!r}")
    return sigma


def _grid(grid: Any) -> tuple[int, np.ndarray | None]:
    """(the number of points, the points or None for that many over the spectrum) from ``grid``: an
    integer >= 2 or a finite, increasing 1-D array of at least 2 points."""
    if np.ndim(grid) == 0:
        points = positive_int(grid, "grid")
        if points < 2:
            raise ValueError(f"grid must be at least 2 points, got {points}")
        return points, None
    x = float_array(grid, "grid", ndim=1)
    if x.shape[0] < 2 or not np.all(np.diff(x) > 0):
        raise ValueError(f"grid must be an increasing 1-D array of at least 2 points, got shape {tuple(x.shape)}")
    return x.shape[0], np.array(x, dtype=np.float64)  # its own copy, like every result


def spectral_density(matvec: Callable[[np.ndarray], np.ndarray], P: int, *, probes: int = 10, steps: int = 60,
                     sigma: float | None = None, grid: int | np.ndarray = 1000, seed: int = 0,
                     progress: Callable[[], None] | None = None) -> SpectralDensity:
    """Stochastic Lanczos quadrature of the symmetric operator ``matvec`` of size ``P``.

    probes: Rademacher probes; steps: Lanczos steps per probe (at most P); sigma: the Gaussian
    broadening (default: 1% of the spectrum's extent, or 1 for the zero operator, which has none);
    grid: the number of points over the spectrum's range widened by 5 sigma on each side, or the
    points themselves."""
    P = positive_int(P, "P")
    probes, steps = positive_int(probes, "probes"), positive_int(steps, "steps")
    sigma = _sigma(sigma)
    points, x = _grid(grid)
    # Checked before the first product: the grid and the density, one probe's Lanczos basis and its
    # Gaussians on the grid.
    basis_steps = min(steps, P)
    require_output_fits((2, points), _FLOAT64, f"the spectral density on a grid of {points} points, from "
                        f"Lanczos bases of {basis_steps} steps (P = {P}),", "pass a smaller grid or fewer steps",
                        working=8 * basis_steps * (P + points))
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
        extent = 0.01 * max(hi - lo, abs(hi), abs(lo))
        sigma = extent if extent >= _SMALLEST_SIGMA else 1.0  # the zero operator's spectrum has no extent
    if x is None:
        x = np.linspace(lo - 5 * sigma, hi + 5 * sigma, points)
    density = np.zeros_like(x)
    outside = 0.0
    root2 = sigma * math.sqrt(2)
    erf = np.vectorize(math.erf)  # over a probe's nodes only
    for theta, tau in zip(nodes, weights):
        gaussians = np.subtract.outer(x, theta)  # (points, nodes), in place from here on
        gaussians /= root2
        with np.errstate(over="ignore"):  # nodes far from a point: exp(-inf) = 0
            np.square(gaussians, out=gaussians)
        np.exp(np.negative(gaussians, out=gaussians), out=gaussians)
        density += gaussians @ tau
        inside = 0.5 * (erf((x[-1] - theta) / root2) - erf((x[0] - theta) / root2))
        outside += float(tau @ (1 - inside))
    density /= probes * sigma * math.sqrt(2 * math.pi)
    return SpectralDensity(grid=x, density=density, nodes=nodes, weights=weights, probes=probes,
                           steps=steps, sigma=float(sigma), truncation=outside / probes)


def _dense_eigh(operator: Any, vectors: bool):
    """Every eigenvalue (ascending), and the eigenvectors when asked for, of the dense matrix formed
    by the operator's products with the identity: exact, for small sizes."""
    P = operator.shape[0]
    require_output_fits((P, P), _FLOAT64, f"the dense ({P}, {P}) operator eigsh forms at this size",
                        "ask for fewer eigenvalues (k < (P - 1) / 2) of a larger operator", working=8 * P * (P + 1))
    H = np.asarray(operator.to_scipy().matmat(np.eye(P)), dtype=np.float64)
    H += H.T  # symmetric to rounding; made exactly so
    H *= 0.5
    return np.linalg.eigh(H) if vectors else (np.linalg.eigvalsh(H), None)


def arpack_basis(P: int, k: int, itemsize: int = 8) -> int:
    """The Krylov basis ARPACK keeps for k eigenvalues of a (P, P) operator: scipy's default ncv,
    max(2k + 1, 20), or fewer vectors where that basis would not fit the memory budget (a whole
    model's P), down to 2k + 1. Fewer vectors cost more restarts (more products), not accuracy.
    itemsize: of the operator's dtype, in which ARPACK then works."""
    least, default = min(P, 2 * k + 1), min(P, max(2 * k + 1, 20))
    fits = get_memory_budget() // (itemsize * (P + default + 8))
    return max(least, min(default, fits))


def arpack_memory(P: int, k: int, itemsize: int = 8) -> int:
    """Bytes of ARPACK's basis and work array for k eigenvalues of a (P, P) operator."""
    ncv = arpack_basis(P, k, itemsize)
    return itemsize * ncv * (P + ncv + 8)


def _arpack(operator: Any, k: int, which: str, tol: float, vectors: bool):
    """ARPACK's k eigenvalues of ``which`` (and eigenvectors), its failures as blockhess's errors."""
    try:
        from scipy.sparse.linalg import ArpackError, ArpackNoConvergence
        from scipy.sparse.linalg import eigsh as arpack
    except ImportError as err:  # pragma: no cover - scipy is in the test extra
        raise ImportError("eigsh() needs scipy: pip install scipy") from err
    P = operator.shape[0]
    itemsize = np.dtype(getattr(operator, "dtype", np.float64)).itemsize  # ARPACK works in the operator's dtype
    ncv = arpack_basis(P, k, itemsize)
    require_output_fits((P, k) if vectors else (k,), _FLOAT64, f"eigsh's {k} eigenvalues (P = {P})",
                        "ask for fewer eigenvalues (a smaller k)", working=arpack_memory(P, k, itemsize))
    A = operator.to_scipy()
    v0 = np.random.default_rng(0).standard_normal(P)  # ARPACK's random start, made reproducible
    try:
        result = arpack(A, k=k, which=which, tol=tol, v0=v0, ncv=ncv, return_eigenvectors=vectors)
    except ArpackNoConvergence as err:
        raise ValueError(f"eigsh did not converge: ARPACK found {len(err.eigenvalues)} of the k={k} eigenvalues "
                         f"which={which!r} to tol={tol} within its iteration limit; pass a larger tol or a "
                         "smaller k") from None
    except ArpackError as err:
        # H v0 = 0 for a random v0 only when H = 0 (a nonzero H's null space has measure zero),
        # where ARPACK stops on its start vector: every eigenvalue is 0, any basis its eigenvectors.
        if not np.any(A.matvec(v0)):
            return (np.zeros(k), np.eye(P, k)) if vectors else np.zeros(k)
        raise ValueError(f"eigsh failed: ARPACK could not compute the k={k} eigenvalues which={which!r} ({err})") \
            from None
    return result


def eigsh(operator: Any, k: int, which: str, tol: float, return_eigenvectors: bool):
    """The k eigenvalues of ``which`` ("LA" largest, "SA" smallest algebraic, "LM" largest
    magnitude) of a symmetric operator through its products; ascending, with eigenvectors as
    columns when asked for. Exact for a small operator (P <= 100) or k >= (P - 1) / 2, where the
    dense matrix is formed and diagonalised; else scipy's ARPACK Lanczos (the zero operator: zeros)."""
    which = choice(which, "which", ("LA", "SA", "LM"))
    P = operator.shape[0]
    k = positive_int(k, "k")
    if k >= P:
        raise ValueError(f"k must be smaller than the operator's size {P}, got {k}")
    tol = nonneg_scalar(tol, "tol")
    if not isinstance(return_eigenvectors, (bool, np.bool_)):
        raise TypeError(f"return_eigenvectors must be True or False, got {type(return_eigenvectors).__name__}")
    vectors = bool(return_eigenvectors)
    if P <= _DENSE_UP_TO or 2 * k + 1 >= P:
        values, basis = _dense_eigh(operator, vectors)
        if which == "LA":
            chosen = np.arange(P - k, P)
        elif which == "SA":
            chosen = np.arange(k)
        else:  # the k largest magnitudes, in ascending order of value
            chosen = np.sort(np.argsort(np.abs(values), kind="stable")[P - k:])
        return (values[chosen], basis[:, chosen]) if vectors else values[chosen]
    result = _arpack(operator, k, which, tol, vectors)
    if not vectors:
        return np.sort(result)
    values, basis = result
    order = np.argsort(values)
    return values[order], basis[:, order]
