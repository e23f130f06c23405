"""Independent references for the tests: PyTorch autograd in float64, written from the model
definitions in spec §1 (never from blockhess's formulas), plus finite differences."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.func import hessian, jacrev

torch.set_default_dtype(torch.float64)


def t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64))


def rel_err(a, b, scale: float = 1e-300) -> float:
    """||a - b||_F / max(||b||_F, scale). Pass a natural scale when b is exactly zero in theory
    (e.g. LayerNorm with d = 2, whose output is constant), where autograd returns rounding noise."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), scale))


def layernorm(X, eps=0.0, gamma=None, beta=None):
    mu = X.mean(-1, keepdim=True)
    var = ((X - mu) ** 2).mean(-1, keepdim=True)
    Z = (X - mu) / torch.sqrt(var + eps)
    if gamma is not None:
        Z = Z * gamma
    if beta is not None:
        Z = Z + beta
    return Z


def softmax_rows(T):
    return torch.softmax(T, dim=-1)


def attention(X, WQ, WK, WV):
    dk = WQ.shape[1]
    T = X @ WQ @ WK.T @ X.T / math.sqrt(dk)
    return softmax_rows(T) @ X @ WV


def ffn(Y, W1, W2):
    return torch.relu(Y @ W1) @ W2


def jacobian(f, x):
    """d vec_r f / d vec_r x^T as a numpy array of shape (out.size, x.size)."""
    x = t(x)
    out = f(x)
    return jacrev(f)(x).reshape(out.numel(), x.numel()).numpy()


def second_derivative(f, x):
    """The spec's layout: (out.size * x.size, x.size)."""
    x = t(x)
    out = f(x)
    return hessian(f)(x).reshape(out.numel() * x.numel(), x.numel()).numpy()


def finite_difference_jacobian(f, x, h=1e-5):
    """Central differences of a numpy function f; (f(x).size, x.size)."""
    x = np.asarray(x, dtype=np.float64)
    cols = []
    for k in range(x.size):
        e = np.zeros(x.size)
        e[k] = h
        cols.append((np.ravel(f(x + e.reshape(x.shape))) - np.ravel(f(x - e.reshape(x.shape)))) / (2 * h))
    return np.stack(cols, axis=1)


def cross_second_derivative(f, x, y):
    """d/dy of (d vec_r f(x, y) / d vec_r x) in the spec's layout: (out.size * x.size, y.size)."""
    x, y = t(x), t(y)
    out = f(x, y)
    d2 = jacrev(jacrev(f, argnums=0), argnums=1)(x, y)
    return d2.reshape(out.numel() * x.numel(), y.numel()).numpy()


def commutation_from_definition(m, n):
    """K_{m,n} built column by column from its definition K vec(A) = vec(A^T), vec column-major."""
    K = np.zeros((m * n, m * n))
    for c in range(m * n):
        e = np.zeros(m * n)
        e[c] = 1.0
        A = e.reshape((m, n), order="F")  # vec(A) = e_c
        K[:, c] = A.T.reshape(-1, order="F")
    return K
