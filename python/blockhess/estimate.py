"""Hutchinson's estimates of a curvature operator's diagonal and traces, and Hutch++'s of its
trace, for where the exact ones cost too much: each is returned as an :class:`Estimate`, never as a
bare number, with the standard error that the spread of its probes gives.

For Rademacher probes z_k (entries +-1), E[z_k * (H z_k)] = diag(H) and E[z_k^T H z_k] = tr(H); the
mean over m probes estimates them, and the sample standard deviation over the probes divided by
sqrt(m) is the standard error of that mean (docs/derivation.md §5.4). Hutch++ (Meyer, Musco, Musco
and Woodruff, 2021) spends a third of its products on a sketch H S whose orthonormal basis Q carries
the top of the spectrum, whose trace tr(Q^T H Q) it takes exactly with another third, and
Hutchinson's estimate on the rest, (I - QQ^T) H (I - QQ^T), with the last third: for a curvature
matrix whose spectrum decays, a much smaller error for the same products.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np


class Estimate(NamedTuple):
    """A stochastic estimate: ``value`` (a float, or an array for a diagonal), its ``standard_error``
    (same shape) and the number of ``probes`` it took. ``value +- 2 * standard_error`` covers the
    exact quantity about 95% of the time."""

    value: Any
    standard_error: Any
    probes: int


def hutchinson(product: Callable[[np.ndarray], np.ndarray], sizes: tuple[int, ...], dtype: np.dtype, probes: int,
               seed: int, chunk: int) -> tuple[Estimate, list[Estimate], Estimate]:
    """The diagonal (as one Estimate of arrays), each block's trace (one Estimate per entry of
    ``sizes``) and the whole trace of the operator behind ``product`` (H V for V of shape (P, k)),
    from the same ``probes`` Rademacher probes drawn from ``seed``, ``chunk`` columns at a time."""
    P = int(sum(sizes))
    rng = np.random.default_rng(seed)
    starts = np.cumsum((0, *sizes))[:-1]
    total, squares = np.zeros(P), np.zeros(P)
    block_traces = np.empty((len(sizes), probes))
    for first in range(0, probes, chunk):
        k = min(chunk, probes - first)
        Z = rng.choice(np.array([-1.0, 1.0], dtype=dtype), size=(P, k))
        samples = (Z * product(Z)).astype(np.float64)  # z_k * (H z_k), one column per probe
        total += samples.sum(axis=1)
        squares += np.square(samples).sum(axis=1)
        block_traces[:, first:first + k] = np.add.reduceat(samples, starts, axis=0)
    mean = total / probes
    spread = np.sqrt(np.maximum(squares - probes * np.square(mean), 0.0) / max(probes - 1, 1))
    diagonal = Estimate(mean, spread / np.sqrt(probes), probes)
    traces = [_mean(t) for t in block_traces]
    return diagonal, traces, _mean(block_traces.sum(axis=0))


def hutch_plus_plus(product: Callable[[np.ndarray], np.ndarray], P: int, dtype: np.dtype, probes: int,
                    seed: int) -> Estimate:
    """Hutch++'s estimate of the trace of the operator behind ``product`` (H V for V of shape (P, k))
    from ``probes`` products: k = probes // 3 for the sketch and as many for its basis, the rest (at
    least 2) Rademacher probes of the deflated operator. The standard error is the residual
    probes'; where the sketch spans everything (k >= P) the estimate is the exact trace."""
    rng = np.random.default_rng(seed)
    k = probes // 3
    sign = np.array([-1.0, 1.0], dtype=dtype)
    Q = np.linalg.qr(product(rng.choice(sign, size=(P, k))).astype(np.float64))[0].astype(dtype)
    kept = float(np.einsum("ij,ij->", Q, product(Q), dtype=np.float64))
    G = rng.choice(sign, size=(P, probes - 2 * k))
    G = G - Q @ (Q.T @ G)
    samples = np.einsum("ij,ij->j", G, product(G), dtype=np.float64)
    residual = _mean(samples)
    return Estimate(kept + residual.value, residual.standard_error, probes)


def _mean(samples: np.ndarray) -> Estimate:
    """The mean of one sample per probe, with its standard error."""
    return Estimate(float(samples.mean()), float(samples.std(ddof=1) / np.sqrt(samples.size)), int(samples.size))
