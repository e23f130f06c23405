"""Random configurations the bounds are checked on: several shapes, weight scales from 0.1 to 10,
eps 0 and > 0, and peaked attention built on purpose (every fifth)."""

from __future__ import annotations

import numpy as np

from ..block import BlockParams


def random_configuration(i: int) -> dict:
    """The i-th configuration: ``X`` (L, d), an mse ``target``, the paper block's ``params``, ``eps``
    and the weight ``scale``; every fifth has logits of order 10-100 (most softmax rows on one or
    two keys)."""
    rng = np.random.default_rng(1000 + i)
    L, d, d_k, d_ff = (int(rng.integers(a, b)) for a, b in ((2, 8), (3, 6), (1, 4), (2, 8)))
    scale = float(10 ** rng.uniform(-1, 1))
    X = rng.standard_normal((L, d))
    W = [scale * np.asarray(w) for w in BlockParams.random(d=d, d_k=d_k, d_ff=d_ff, seed=i).arrays]
    if i % 5 == 0:
        X, W[0] = 3 * X, 10 * W[0] / max(scale, 1.0)
    return dict(X=X, target=rng.standard_normal((L, d)), params=BlockParams(*W),
                eps=0.0 if i % 2 == 0 else 0.05, scale=scale, peaked=i % 5 == 0)
