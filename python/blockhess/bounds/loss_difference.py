"""Thm 7: how much the empirical risk moves when one sample is added (paper.md §4.5).

With l_i >= 0 the per-sample losses, L_k their running mean and H^(k) the mean of the per-sample
Hessians, the paper bounds the quadratic model q_k(w) = L_k(w*) + 1/2 d^T H^(k)(w*) d, d = w - w*:

    |q_{k+1}(w) - q_k(w)| <= 2 Lmax / (k+1) + M ||d||^2 / (k+1)     (as stated)

where Lmax bounds the losses at w* and M every ||H_i(w*)||. Corrected (erratum E17): since
q_{k+1} - q_k = (l_{k+1} - L_k)/(k+1) + 1/2 d^T (H_{k+1} - H^(k)) d/(k+1) and both l_{k+1} and L_k lie in
[0, Lmax], |l_{k+1} - L_k| <= Lmax, not 2 Lmax; ||H_{k+1} - H^(k)|| <= 2M gives the M term unchanged:

    |q_{k+1}(w) - q_k(w)| <= (Lmax + M ||d||^2) / (k+1).

The bound is on the quadratic model only. For the loss itself, exactly
L_{k+1}(w) - L_k(w) = (l_{k+1}(w) - L_k(w))/(k+1), so |L_{k+1}(w) - L_k(w)| <= max_i l_i(w)/(k+1) with no
Taylor model at all: at w = w* (the paper's Exp5) the Hessian term vanishes and Exp5 tests only this.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._bound import Bound


def theorem7_rhs(k: Any, loss_bound: float, *, M: float = 0.0, distance: float = 0.0) -> dict[str, np.ndarray]:
    """The right-hand side of Thm 7 at sample counts ``k`` (k >= 1, the count before the new sample).

    Returns ``{"stated": 2 Lmax/(k+1) + M d^2/(k+1), "corrected": (Lmax + M d^2)/(k+1)}`` as arrays,
    ``loss_bound`` = Lmax, ``distance`` = ||w - w*||_2.
    """
    k = np.asarray(k, dtype=np.float64)
    if np.any(k < 1):
        raise ValueError(f"k counts the samples seen before the new one and must be >= 1, got min {k.min()}")
    for name, value in (("loss_bound", loss_bound), ("M", M), ("distance", distance)):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    curvature = M * distance**2
    return {"stated": (2 * loss_bound + curvature) / (k + 1), "corrected": (loss_bound + curvature) / (k + 1)}


def running_differences(sample_losses: Any) -> tuple[np.ndarray, np.ndarray]:
    """``k = 1..n-1`` and ``|L_{k+1} - L_k|`` for the running means L_k of ``sample_losses`` (n,)."""
    losses = np.asarray(sample_losses, dtype=np.float64).reshape(-1)
    if losses.size < 2:
        raise ValueError(f"need at least 2 per-sample losses, got {losses.size}")
    means = np.cumsum(losses) / np.arange(1, losses.size + 1)
    return np.arange(1, losses.size), np.abs(np.diff(means))


def quadratic_model_differences(sample_losses: Any, sample_curvatures: Any) -> tuple[np.ndarray, np.ndarray]:
    """``k`` and ``|q_{k+1}(w) - q_k(w)|`` of Thm 7's quadratic model, from the losses l_i(w*) and the
    curvatures c_i = 1/2 d^T H_i(w*) d of every sample along one displacement d."""
    losses = np.asarray(sample_losses, dtype=np.float64).reshape(-1)
    curvatures = np.asarray(sample_curvatures, dtype=np.float64).reshape(-1)
    if curvatures.shape != losses.shape:
        raise ValueError(f"sample_curvatures must have the shape of sample_losses {losses.shape}, got {curvatures.shape}")
    return running_differences(losses + curvatures)


def theorem7(sample_losses: Any, sample_curvatures: Any, *, M: float, distance: float) -> Bound:
    """The worst k of Thm 7 on given samples: the largest (k+1) |q_{k+1} - q_k| against the
    right-hand side times (k+1) (the same for every k), Lmax = max_i l_i(w*).

    ``sample_curvatures`` are c_i = 1/2 d^T H_i(w*) d along d = w - w* with ||d|| = ``distance``; ``M``
    bounds every ||H_i(w*)|| (e.g. the largest exact per-sample norm, or Thm 6's M_tr)."""
    losses = np.asarray(sample_losses, dtype=np.float64).reshape(-1)
    if np.any(losses < 0):
        raise ValueError("Thm 7 needs per-sample losses >= 0")
    k, differences = quadratic_model_differences(losses, sample_curvatures)
    rhs = theorem7_rhs(k, float(losses.max()), M=M, distance=distance)
    worst = int(np.argmax(differences * (k + 1)))
    return Bound(
        quantity="Thm 7: max_k (k+1)|q_{k+1}(w) - q_k(w)|",
        exact=float(differences[worst] * (k[worst] + 1)),
        stated=float(rhs["stated"][worst] * (k[worst] + 1)),
        corrected=float(rhs["corrected"][worst] * (k[worst] + 1)),
        erratum="E17",
        source="Thm 7",
    )
