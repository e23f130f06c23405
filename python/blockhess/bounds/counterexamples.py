"""Inputs on which the paper's bounds fail as stated (docs/errata.md); tests assert they do.

Each is an input, not a result: the exact values come from blockhess every time.
"""

from __future__ import annotations

import numpy as np


def e11_attention() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X, W_Q, W_K, W_V) at (L, d_V, d_K) = (9, 2, 1) where the attention is peaked on a few keys
    (rows of A reach 0.59), found by maximising ||H_o(Q,Q)|| over the appendix's 2/L^3 bound
    (Nelder-Mead from random starts, rounded to 2 decimals): the exact outer (Q,Q) block is 6.1x
    the bound, because ||dA/dT|| reaches far above the uniform 1/L = 0.11 (it is at most 1/2)."""
    X = np.array([[-1.01, -0.59], [0.02, -0.33], [3.01, -0.03], [-0.8, -0.52], [0.52, -0.21], [0.99, -0.15],
                  [-0.22, 3.33], [-0.19, -0.29], [-0.08, -0.33]])
    W_Q = np.array([[-0.42], [0.07]])
    W_K = np.array([[-0.31], [1.7]])
    W_V = np.array([[0.0, -0.45], [1.42, 3.32]])
    return X, W_Q, W_K, W_V


def e14_layernorm() -> np.ndarray:
    """A LayerNorm input (2, 7) on which both Lemma 4 bounds fail with sigma_min printed as the
    smallest centred row norm (1.7x and 2.0x) and hold with the row std."""
    rng = np.random.default_rng(37)
    m, n = rng.integers(2, 8), rng.integers(3, 9)
    return rng.standard_normal((m, n)) * 10 ** rng.uniform(-1, 1)
