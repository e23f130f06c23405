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


# ---- the post-LN Transformer block of spec §1.5, written from the model definition ----

PARAM_NAMES = ("W_Q", "W_K", "W_V", "W_1", "W_2")


def random_block(rng, L, d, dk, dff, B=None, scale=0.6):
    """Random input, MSE target, class target and weights of a block (float64 numpy)."""
    lead = (L,) if B is None else (B, L)
    X = rng.standard_normal((*lead, d))
    shapes = [(d, dk), (d, dk), (d, d), (d, dff), (dff, d)]
    weights = [rng.standard_normal(s) * scale / np.sqrt(s[0]) * 2 for s in shapes]
    target = rng.standard_normal((*lead, d))
    classes = rng.integers(0, d, size=lead)
    return X, weights, target, classes


def transformer_block(X, WQ, WK, WV, W1, W2, eps=0.0):
    """Z for X of shape (L, d) or (B, L, d)."""
    dk = WQ.shape[1]
    T = X @ WQ @ WK.T @ X.transpose(-1, -2) / math.sqrt(dk)
    F = torch.softmax(T, dim=-1) @ X @ WV
    Y = layernorm(X + F, eps)
    S = torch.relu(Y @ W1) @ W2 + Y
    return layernorm(S, eps)


def unflatten(v, shapes):
    out, o = [], 0
    for s in shapes:
        n = s[0] * s[1]
        out.append(v[o:o + n].reshape(s))
        o += n
    return out


def block_loss(Z, target, loss):
    """Batch-mean loss: mse = mean (Z - target)^2; cross_entropy = mean over tokens of -log softmax."""
    if loss == "mse":
        return ((Z - target) ** 2).mean()
    logits = Z.reshape(-1, Z.shape[-1])
    return torch.nn.functional.cross_entropy(logits, target.reshape(-1), reduction="mean")


def block_loss_derivatives(X, weights, target, loss, eps):
    """(gradient, full Hessian, outer part J^T H_l J) of the loss over all five flattened weights."""
    shapes = [w.shape for w in weights]
    Xt = t(X)
    tgt = t(target) if loss == "mse" else torch.as_tensor(np.asarray(target, dtype=np.int64))
    v0 = torch.cat([t(w).reshape(-1) for w in weights])

    def Z_of(v):
        return transformer_block(Xt, *unflatten(v, shapes), eps=eps)

    def loss_of(v):
        return block_loss(Z_of(v), tgt, loss)

    grad = torch.func.grad(loss_of)(v0).numpy()
    full = hessian(loss_of)(v0).numpy()
    Z0 = Z_of(v0)
    J = jacrev(Z_of)(v0).reshape(Z0.numel(), -1)
    HZ = hessian(lambda z: block_loss(z.reshape(Z0.shape), tgt, loss))(Z0.reshape(-1))
    outer = (J.T @ HZ @ J).numpy()
    return grad, full, outer
