"""The paper's scaling claims, measured (its Thm 1 and its scaling-law discussion): exact block
norms as the input is scaled and as the sequence grows, with fitted log-log exponents, and how
negative the curvature gets.

Thm 1 states the attention layer's curvature grows as ||X||^6 ("O(||X||^6)") and carries 1/L^3
sequence-length terms; :func:`scale_sweep` and :func:`length_sweep` measure both on the exact Hessian of
any block (the lone attention layer, ``BlockSpec(attention_only=True)``, is Thm 1's model; the paper's
block, Thm 6's). Each returns a :class:`Sweep` with the exact spectral norm of every parameter block
at every point, the least-squares slope of log norm against log c (or log L), and the smallest
eigenvalue of every diagonal block, of the functional part and of the whole Hessian: the non-convexity
the functional part brings.

A power law holds only over a range: a large scale saturates the softmax (peaked attention, whose
derivatives vanish) and LayerNorm divides by the scale it removes; so besides the slope over the whole
sweep, ``leading_exponents`` fits the lower half of it (small inputs: near-uniform attention, where
Thm 1's powers are meant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .block import BlockParams, loss_hessian

# The exponents Thm 1 gives its blocks in ||X|| (the largest power in each argument of its max; the
# (K,K) and (V,K) blocks, which the max omits, by the Q <-> K symmetry), and in L (the smallest).
CLAIMED_X_EXPONENTS = {("W_V", "W_V"): 2, ("W_Q", "W_Q"): 6, ("W_Q", "W_V"): 4, ("W_Q", "W_K"): 6,
                       ("W_K", "W_K"): 6, ("W_K", "W_V"): 4}
CLAIMED_L_EXPONENTS = {("W_V", "W_V"): 1, ("W_Q", "W_Q"): -3, ("W_Q", "W_V"): -2, ("W_Q", "W_K"): -3,
                       ("W_K", "W_K"): -3, ("W_K", "W_V"): -2}


@dataclass
class Sweep:
    """Exact curvature along one sweep: ``variable`` ("scale" or "L") takes ``values``."""

    variable: str
    values: list[float]
    norms: dict[tuple[str, str], list[float]]          # ||H[a, b]||_2 at each value
    exponents: dict[tuple[str, str], float]            # fitted d log||H[a, b]|| / d log value, every point
    leading_exponents: dict[tuple[str, str], float]    # the same over the lower half of the values
    claimed: dict[tuple[str, str], float]              # Thm 1's exponent (the attention layer only)
    min_eigenvalue: dict[str, list[float]]             # "full", "functional", and each "a" (full H[a, a])
    min_eigenvalue_functional: dict[str, list[float]] = field(default_factory=dict)  # functional H[a, a]

    def to_dict(self) -> dict:
        key = "{},{}".format
        return {"variable": self.variable, "values": self.values,
                "norms": {key(*k): v for k, v in self.norms.items()},
                "exponents": {key(*k): v for k, v in self.exponents.items()},
                "leading_exponents": {key(*k): v for k, v in self.leading_exponents.items()},
                "claimed": {key(*k): v for k, v in self.claimed.items()},
                "min_eigenvalue": self.min_eigenvalue, "min_eigenvalue_functional": self.min_eigenvalue_functional}

    def most_negative(self) -> tuple[str, float]:
        """The diagonal block whose full Hessian has the most negative eigenvalue along the sweep."""
        blocks = {k: min(v) for k, v in self.min_eigenvalue.items() if k not in ("full", "functional")}
        name = min(blocks, key=blocks.get)
        return name, blocks[name]


def fitted_exponent(x: Any, y: Any) -> float:
    """The least-squares slope of log y against log x over the points with y > 0 (nan if < 2)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = y > 1e-300
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(x[keep]), np.log(y[keep]), 1)[0])


def _curvature(X: np.ndarray, target: np.ndarray, params: BlockParams, eps: float) -> dict[str, Any]:
    full = loss_hessian(X, target, params, eps=eps)
    functional = loss_hessian(X, target, params, eps=eps, part="functional")
    where = params.slices()
    names = params.names
    return {
        "norms": {(a, b): float(np.linalg.norm(full[where[a], where[b]], 2)) for i, a in enumerate(names)
                  for b in names[i:]},
        "min": {"full": float(np.linalg.eigvalsh(full)[0]), "functional": float(np.linalg.eigvalsh(functional)[0]),
                **{a: float(np.linalg.eigvalsh(full[where[a], where[a]])[0]) for a in names}},
        "min_functional": {a: float(np.linalg.eigvalsh(functional[where[a], where[a]])[0]) for a in names},
    }


def _sweep(variable: str, values: list[float], problem_at: Callable[[float], tuple], params: BlockParams,
           eps: float, claimed: dict, progress: Callable[[], None] | None) -> Sweep:
    points = []
    for v in values:
        X, target, p = problem_at(v)
        points.append(_curvature(X, target, p, eps))
        if progress is not None:
            progress()
    norms = {k: [pt["norms"][k] for pt in points] for k in points[0]["norms"]}
    half = max(2, (len(values) + 1) // 2)
    return Sweep(
        variable=variable, values=[float(v) for v in values], norms=norms,
        exponents={k: fitted_exponent(values, v) for k, v in norms.items()},
        leading_exponents={k: fitted_exponent(values[:half], v[:half]) for k, v in norms.items()},
        claimed={k: v for k, v in claimed.items() if k in norms} if params.spec.attention_only else {},
        min_eigenvalue={k: [pt["min"][k] for pt in points] for k in points[0]["min"]},
        min_eigenvalue_functional={k: [pt["min_functional"][k] for pt in points] for k in points[0]["min_functional"]},
    )


def scale_sweep(X: Any, target: Any, params: BlockParams, *, scales: Any = None, eps: float = 0.0,
                progress: Callable[[], None] | None = None) -> Sweep:
    """The exact Hessian at c X for c over ``scales`` (default: 9 points over two decades, 0.1 to 10),
    the target and weights fixed."""
    scales = np.logspace(-1, 1, 9) if scales is None else np.asarray(scales, dtype=np.float64)
    if scales.ndim != 1 or scales.size < 2 or np.any(scales <= 0):
        raise ValueError(f"scales must be at least 2 positive numbers, got {scales!r}")
    X, target = np.asarray(X, dtype=np.float64), np.asarray(target, dtype=np.float64)
    return _sweep("scale", list(scales), lambda c: (c * X, target, params), params, eps, CLAIMED_X_EXPONENTS, progress)


def length_sweep(params: BlockParams, *, lengths: Any = (4, 8, 16, 32, 64), seed: int = 0, eps: float = 0.0,
                 progress: Callable[[], None] | None = None) -> Sweep:
    """The exact Hessian for sequences of each length L in ``lengths``: tokens and targets i.i.d.
    N(0, 1) (the same random stream for every L, so a longer sequence extends a shorter one)."""
    lengths = [int(n) for n in lengths]
    if len(lengths) < 2 or min(lengths) < 1:
        raise ValueError(f"lengths must be at least 2 lengths >= 1, got {lengths!r}")
    d = params.d
    rng = np.random.default_rng(seed)
    X_all, target_all = rng.standard_normal((max(lengths), d)), rng.standard_normal((max(lengths), d))
    return _sweep("L", lengths, lambda L: (X_all[:L], target_all[:L], params), params, eps, CLAIMED_L_EXPONENTS,
                  progress)
