"""Proposition 10: the norms of Y, FFN(Y) and S in the paper's block.

As stated: ||Y|| <= sqrt(L d); ||FFN(Y)|| <= sqrt(min(L, d_ff)) ||Y|| ||W_1|| ||W_2||;
||S|| <= sqrt(L d) (1 + sqrt(min(L, d_ff)) ||W_1|| ||W_2||). All three hold, also with eps > 0 (each
row of Y then has norm^2 d var/(var + eps) <= d).

Corrected (tighter where it differs; no erratum): ||Y|| as stated; ||relu(Y W_1)|| <= ||relu(Y W_1)||_F <= ||Y W_1||_F <= ||Y||_F ||W_1||, and
||Y W_1||_F <= sqrt(rank) ||Y W_1|| with rank <= min(L, d, d_ff); so
||FFN(Y)|| <= ||W_1|| ||W_2|| min(||Y||_F, sqrt(min(L, d, d_ff)) ||Y||), and ||S|| <= ||Y|| + that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..attention import attention
from ..block import _eps
from ..ffn import ffn
from ..layernorm import layernorm
from ._bound import Bound
from ._float import frobenius, overflow_is_inf
from ._paper_block import paper_params, samples_of


@overflow_is_inf
def proposition10(X: Any, params: Any, *, eps: float | None = None) -> list[Bound]:
    """Prop 10 at X (L, d) (a batch (B, L, d): the worst sample of each quantity, exact and bounds
    taken at that sample), with the LayerNorm's ``eps`` (default: the spec's)."""
    W_Q, W_K, W_V, W_1, W_2 = paper_params(params)
    eps = _eps(eps, params)
    n1, n2 = np.linalg.norm(W_1, 2), np.linalg.norm(W_2, 2)
    rows = []
    for x in samples_of(X):
        L, d = x.shape
        d_ff = W_1.shape[1]
        Y = layernorm(x + attention(x, W_Q, W_K, W_V), eps)
        G = ffn(Y, W_1, W_2)
        Y_norm, Y_frob = np.linalg.norm(Y, 2), frobenius(Y)
        ffn_corrected = n1 * n2 * min(Y_frob, np.sqrt(min(L, d, d_ff)) * Y_norm)
        rows.append([
            ("Prop 10: ||Y||", Y_norm, np.sqrt(L * d), np.sqrt(L * d)),
            ("Prop 10: ||FFN(Y)||", float(np.linalg.norm(G, 2)), np.sqrt(min(L, d_ff)) * Y_norm * n1 * n2, ffn_corrected),
            ("Prop 10: ||S||", float(np.linalg.norm(Y + G, 2)), np.sqrt(L * d) * (1 + np.sqrt(min(L, d_ff)) * n1 * n2),
             Y_norm + ffn_corrected),
        ])
    out = []
    for q in range(3):
        quantity, exact, stated, corrected = max((r[q] for r in rows), key=lambda r: r[1])
        out.append(Bound(quantity, float(exact), float(stated), float(corrected), source="Prop 10"))
    return out
