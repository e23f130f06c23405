"""The paper's block, one sample at a time: its intermediates and the norms the bounds are made of."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._validate import float_array
from ..attention import attention
from ..block import _check_params
from ..softmax import softmax
from ..ffn import ffn
from ..layernorm import layernorm
from ._float import frobenius
from .layernorm import row_std


def _norm(A: np.ndarray) -> np.float64:
    """||A||_2 as a numpy float64: the powers the bounds take of it overflow to inf (a Python float's
    would raise OverflowError)."""
    return np.linalg.norm(A, 2)


@dataclass(frozen=True)
class Sample:
    """One sample's sizes and norms (spectral unless named otherwise), the norms numpy float64."""

    L: int
    d: int
    d_k: int
    X: float
    W_Q: float
    W_K: float
    W_V: float
    W_1: float = 0.0
    W_2: float = 0.0
    d_ff: int = 0
    target_frobenius: float = 0.0
    residual_frobenius: float = 0.0  # ||output - target||_F
    Y: float = 0.0                   # ||Y||_2
    relu: float = 0.0                # ||relu(Y W_1)||_2 = ||B_2||
    sigma_min_S0: float = 0.0        # row std of the first LayerNorm's input X + F
    sigma_min_S: float = 0.0         # row std of the second's, Y + FFN(Y)
    S0: float = 0.0                  # ||X + F||_2, the first LayerNorm's input (Lemma 4's ||X||)
    S: float = 0.0                   # ||Y + FFN(Y)||_2, the second's
    attention_max: float = 1.0       # the largest attention weight, max_ij A_ij (1/L: uniform)
    key_max: float = 0.0             # the largest column sum of A: how much one key is attended to


def paper_params(params: Any) -> tuple[np.ndarray, ...]:
    """W_Q, W_K, W_V (and W_1, W_2) as float64 arrays, after checking the spec is one the bounds are
    about: the paper's block, or the lone attention layer of Thm 1."""
    spec = _check_params(params).spec
    if not replace(spec, attention_only=False).is_paper_block:
        raise ValueError(f"the paper's bounds are for its block (BlockSpec()) or its attention layer "
                         f"(BlockSpec(attention_only=True)), got {spec}")
    names = ("W_Q", "W_K", "W_V") if spec.attention_only else ("W_Q", "W_K", "W_V", "W_1", "W_2")
    return tuple(np.asarray(params[n], dtype=np.float64) for n in names)


def samples_of(X: Any, name: str = "X") -> np.ndarray:
    """``X`` (L, d) or (B, L, d), checked, as float64 (B, L, d)."""
    X = np.asarray(float_array(X, name, ndim=(2, 3)), dtype=np.float64)
    return X[None] if X.ndim == 2 else X


def _attention_weights(X: np.ndarray, W_Q: np.ndarray, W_K: np.ndarray) -> dict[str, float]:
    A = softmax(X @ W_Q @ (X @ W_K).T / np.sqrt(W_Q.shape[1]))
    return {"attention_max": float(A.max()), "key_max": float(A.sum(axis=0).max())}


def attention_sample(X: np.ndarray, target: np.ndarray, W: tuple[np.ndarray, ...]) -> Sample:
    W_Q, W_K, W_V = W[:3]
    L, d = X.shape
    F = attention(X, W_Q, W_K, W_V)
    return Sample(L=L, d=d, d_k=W_Q.shape[1], X=_norm(X), W_Q=_norm(W_Q), W_K=_norm(W_K), W_V=_norm(W_V),
                  target_frobenius=frobenius(target), residual_frobenius=frobenius(F - target),
                  **_attention_weights(X, W_Q, W_K))


def block_sample(X: np.ndarray, target: np.ndarray, W: tuple[np.ndarray, ...], eps: float) -> Sample:
    W_Q, W_K, W_V, W_1, W_2 = W
    L, d = X.shape
    S0 = X + attention(X, W_Q, W_K, W_V)
    Y = layernorm(S0, eps)
    S = Y + ffn(Y, W_1, W_2)
    Z = layernorm(S, eps)
    return Sample(L=L, d=d, d_k=W_Q.shape[1], X=_norm(X), W_Q=_norm(W_Q), W_K=_norm(W_K), W_V=_norm(W_V),
                  W_1=_norm(W_1), W_2=_norm(W_2), d_ff=W_1.shape[1],
                  target_frobenius=frobenius(target), residual_frobenius=frobenius(Z - target),
                  Y=_norm(Y), relu=_norm(np.maximum(Y @ W_1, 0.0)),
                  sigma_min_S0=row_std(S0, eps).min(), sigma_min_S=row_std(S, eps).min(), S0=_norm(S0), S=_norm(S),
                  **_attention_weights(X, W_Q, W_K))
