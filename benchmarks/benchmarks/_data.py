"""The seeded inputs of every CPU workload (identical for all methods that compute the same object)."""

from __future__ import annotations

import math

import numpy as np

from . import _settings


def rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([_settings.SEED, *key])


def _weight(g: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A weight matrix scaled by 1/sqrt(fan-in), as at initialisation."""
    return g.standard_normal((rows, cols)) / math.sqrt(rows)


def layernorm_input(shape, key: int) -> np.ndarray:
    return rng(key, *shape).standard_normal(shape)


def ffn_inputs(shape):
    """Y, W_1, W_2 for (L, d, d_ff)."""
    L, d, dff = shape
    g = rng(3, *shape)
    Y = g.standard_normal((L, d))
    return Y, _weight(g, d, dff), _weight(g, dff, d)


def attention_inputs(shape):
    """X, W_Q, W_K, W_V for (L, d, d_k)."""
    L, d, dk = shape
    g = rng(4, *shape)
    X = g.standard_normal((L, d))
    return X, _weight(g, d, dk), _weight(g, d, dk), _weight(g, d, d)


def block_inputs(shape):
    """X, the MSE target and (W_Q, W_K, W_V, W_1, W_2) for (L, d, d_k, d_ff)."""
    L, d, dk, dff = shape
    g = rng(5, *shape)
    X = g.standard_normal((L, d))
    target = g.standard_normal((L, d))
    weights = tuple(_weight(g, rows, cols) for rows, cols in ((d, dk), (d, dk), (d, d), (d, dff), (dff, d)))
    return X, target, weights


def block_jacobian_stand_in(shape, P: int) -> np.ndarray:
    """A random (L d, P) matrix: the J of the J^T J GEMM floor."""
    L, d = shape[:2]
    return rng(6, *shape).standard_normal((L * d, P))
