"""Thm 7: how much the empirical risk moves when one sample is added.

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

from .._interop import as_array
from .._validate import nonneg_scalar, require_finite
from ._bound import Bound
from ._float import overflow_is_inf, power_of_two_scale


def _numbers(values: Any, name: str, kinds: str) -> np.ndarray:
    """``values`` as a numpy array of a dtype of ``kinds`` ("iu": integers, "iuf": real numbers;
    never bool), or TypeError naming ``name``."""
    array = np.asarray(as_array(values, name))
    if array.dtype.kind not in kinds:
        raise TypeError(f"{name} must hold {'integers' if kinds == 'iu' else 'real numbers'}, got dtype {array.dtype}")
    return array


def _finite_reals(values: Any, name: str) -> np.ndarray:
    """``values`` as a flat float64 array of finite real numbers, or TypeError / ValueError naming ``name``."""
    array = _numbers(values, name, "iuf").astype(np.float64).reshape(-1)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return array


@overflow_is_inf
def theorem7_rhs(k: Any, loss_bound: float, *, M: float = 0.0, distance: float = 0.0) -> dict[str, np.ndarray]:
    """The right-hand side of Thm 7 at sample counts ``k`` (integers >= 1, the count before the new sample).

    Returns ``{"stated": 2 Lmax/(k+1) + M d^2/(k+1), "corrected": (Lmax + M d^2)/(k+1)}`` as arrays,
    ``loss_bound`` = Lmax, ``distance`` = ||w - w*||_2 (inf where a bound is past the float64 range).
    """
    k = _numbers(k, "k", "iu")
    if np.any(k < 1):
        raise ValueError(f"k counts the samples seen before the new one and must be >= 1, got min {k.min()}")
    loss_bound, M, distance = (np.float64(nonneg_scalar(value, name))
                               for name, value in (("loss_bound", loss_bound), ("M", M), ("distance", distance)))
    curvature = M * distance**2
    return {"stated": (2 * loss_bound + curvature) / (k + 1), "corrected": (loss_bound + curvature) / (k + 1)}


@overflow_is_inf
def running_differences(sample_losses: Any) -> tuple[np.ndarray, np.ndarray]:
    """``k = 1..n-1`` and ``|L_{k+1} - L_k|`` for the running means L_k of ``sample_losses`` (n,)."""
    losses = _finite_reals(sample_losses, "sample_losses")
    if losses.size < 2:
        raise ValueError(f"need at least 2 per-sample losses, got {losses.size}")
    scale = power_of_two_scale(losses)  # exact, and the running sums of losses / scale cannot overflow
    means = np.cumsum(losses / scale) / np.arange(1, losses.size + 1)
    return np.arange(1, losses.size), require_finite(scale * np.abs(np.diff(means)), "|L_{k+1} - L_k|")


@overflow_is_inf
def quadratic_model_differences(sample_losses: Any, sample_curvatures: Any) -> tuple[np.ndarray, np.ndarray]:
    """``k`` and ``|q_{k+1}(w) - q_k(w)|`` of Thm 7's quadratic model, from the losses l_i(w*) and the
    curvatures c_i = 1/2 d^T H_i(w*) d of every sample along one displacement d."""
    losses = _finite_reals(sample_losses, "sample_losses")
    curvatures = _finite_reals(sample_curvatures, "sample_curvatures")
    if curvatures.shape != losses.shape:
        raise ValueError(f"sample_curvatures must have the shape of sample_losses {losses.shape}, got {curvatures.shape}")
    return running_differences(require_finite(losses + curvatures, "l_i(w*) + c_i"))


@overflow_is_inf
def theorem7(sample_losses: Any, sample_curvatures: Any, *, M: float, distance: float) -> Bound:
    """The worst k of Thm 7 on given samples: the largest (k+1) |q_{k+1} - q_k| against the
    right-hand side times (k+1) (the same for every k), Lmax = max_i l_i(w*).

    ``sample_curvatures`` are c_i = 1/2 d^T H_i(w*) d along d = w - w* with ||d|| = ``distance``; ``M``
    bounds every ||H_i(w*)|| (e.g. the largest exact per-sample norm, or Thm 6's M_tr)."""
    losses = _finite_reals(sample_losses, "sample_losses")
    if np.any(losses < 0):
        raise ValueError("Thm 7 needs per-sample losses >= 0")
    k, differences = quadratic_model_differences(losses, sample_curvatures)
    rhs = theorem7_rhs(k, losses.max(), M=M, distance=distance)
    worst = int(np.argmax(differences * (k + 1)))
    return Bound(
        quantity="Thm 7: max_k (k+1)|q_{k+1}(w) - q_k(w)|",
        exact=float(differences[worst] * (k[worst] + 1)),
        stated=float(rhs["stated"][worst] * (k[worst] + 1)),
        corrected=float(rhs["corrected"][worst] * (k[worst] + 1)),
        erratum="E17",
        source="Thm 7",
    )
