"""Independent references for the tests: PyTorch autograd in float64 of the model written from its
definition in docs/derivation.md §2 (blockhess._torch_reference, never blockhess's formulas), plus finite
differences and generic helpers."""

from __future__ import annotations

import numpy as np
import torch
from torch.func import hessian, jacrev

import blockhess._torch_reference as torch_reference
from blockhess._torch_reference import PARAM_NAMES, attention, ffn, layernorm, softmax_rows, unflatten  # noqa: F401
from blockhess._torch_reference import block as transformer_block  # noqa: F401
from blockhess._torch_reference import loss as block_loss  # noqa: F401

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


# ---- the post-LN Transformer block of docs/derivation.md §2.1, written from the model definition ----

def random_block(rng, L, d, dk, dff, B=None, scale=0.6):
    """Random input, MSE target, class target and weights of a block (float64 numpy)."""
    lead = (L,) if B is None else (B, L)
    X = rng.standard_normal((*lead, d))
    shapes = [(d, dk), (d, dk), (d, d), (d, dff), (dff, d)]
    weights = [rng.standard_normal(s) * scale / np.sqrt(s[0]) * 2 for s in shapes]
    target = rng.standard_normal((*lead, d))
    classes = rng.integers(0, d, size=lead)
    return X, weights, target, classes


def block_loss_derivatives(X, weights, target, loss, eps):
    """(gradient, full Hessian, outer part J^T H_l J) of the loss over all five flattened weights,
    in float64 numpy."""
    X, target, weights = torch_reference.as_problem(X, target, weights, loss, dtype=torch.float64)
    grad = torch_reference.loss_gradient(X, target, weights, loss, eps)
    full = torch_reference.loss_hessian(X, target, weights, loss, eps, part="full")
    outer = torch_reference.loss_hessian(X, target, weights, loss, eps, part="outer")
    return grad.numpy(), full.numpy(), outer.numpy()


def random_target(rng, loss: str, shape: tuple, d: int, classes: int, dtype=np.float64):
    """A target for ``loss`` on inputs of ``shape`` ((L, d) or (B, L, d)): floats of Z's shape
    (mse), a class in [0, d) per token (cross_entropy), or in [0, classes) per sample (pooled)."""
    if loss == "mse":
        return rng.standard_normal(shape).astype(dtype)
    if loss == "cross_entropy":
        return rng.integers(0, d, shape[:-1])
    return rng.integers(0, classes, shape[:-2])
