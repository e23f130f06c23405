"""Float64 arithmetic for the bounds at any finite input scale.

Norms and row statistics are taken on inputs scaled by a power of two, so that their squares
cannot overflow (the scaling is exact, and the result is the same to the last bit in the usual
range). The bounds themselves are numpy float64 products and powers under :func:`overflow_is_inf`:
a bound past the float range is inf, which is still a bound (a vacuous one), and never a raw
OverflowError from a Python float power.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np


def power_of_two_scale(A: np.ndarray, axis: int | None = None) -> np.ndarray:
    """A power of two within a factor 2 of max |A| along ``axis`` (kept as a length-1 axis; 1/2
    where A is zero): A divided by it is exact and lies in (-2, 2). (2**e > max |A| itself would
    overflow at e = 1024.)"""
    return np.ldexp(1.0, np.frexp(np.abs(A).max(axis=axis, keepdims=True))[1] - 1)


def frobenius(A: np.ndarray) -> np.float64:
    """||A||_F, finite whenever it is representable (numpy's sum of squares overflows near 1e154)."""
    scale = power_of_two_scale(A)
    return scale.reshape(-1)[0] * np.linalg.norm(A / scale)


def overflow_is_inf(function: Callable) -> Callable:
    """Run a bound with numpy's overflow (and the inf * 0 it can lead to) silent: a bound past the
    float range comes out inf or NaN, and :class:`Bound` reads both as inf."""

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):
            return function(*args, **kwargs)

    return bounded
