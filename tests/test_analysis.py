"""blockhess.analysis: the sweeps hold the exact block norms and eigenvalues, the fits recover known
powers, and the attention layer's small-input powers are the ones its structure implies."""

from __future__ import annotations

import json

import numpy as np
import pytest

import blockhess as bh
from blockhess import analysis


def attention_layer(seed=0, d=4, d_k=2):
    W = bh.BlockParams.random(d=d, d_k=d_k, d_ff=1, seed=seed)
    return bh.BlockParams.from_arrays(bh.BlockSpec(attention_only=True), {n: W[n] for n in ("W_Q", "W_K", "W_V")})


def test_fitted_exponent_recovers_a_power_law():
    x = np.logspace(-1, 1, 7)
    assert analysis.fitted_exponent(x, 3 * x**-2.5) == pytest.approx(-2.5, rel=1e-12)
    assert np.isnan(analysis.fitted_exponent(x, np.zeros_like(x)))  # a block that is exactly zero


def test_scale_sweep_holds_the_exact_curvature():
    rng = np.random.default_rng(0)
    params = bh.BlockParams.random(d=4, d_k=2, d_ff=5, seed=1)
    X, target = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    sweep = analysis.scale_sweep(X, target, params, scales=[0.5, 2.0])
    H = bh.loss_hessian(2.0 * X, target, params, layout="blocks")
    assert sweep.norms["W_Q", "W_1"][1] == pytest.approx(np.linalg.norm(H["W_Q", "W_1"], 2), rel=1e-12)
    assert len(sweep.norms) == 15
    dense = bh.loss_hessian(0.5 * X, target, params)
    assert sweep.min_eigenvalue["full"][0] == pytest.approx(np.linalg.eigvalsh(dense)[0], rel=1e-10)
    functional = bh.loss_hessian(0.5 * X, target, params, part="functional", layout="blocks")
    assert sweep.min_eigenvalue_functional["W_V"][0] == pytest.approx(
        np.linalg.eigvalsh(functional["W_V", "W_V"])[0], rel=1e-10, abs=1e-14)
    assert sweep.min_eigenvalue["functional"][0] < 0  # the functional part is indefinite
    block, value = sweep.most_negative()
    assert value == min(min(sweep.min_eigenvalue[n]) for n in params.names)
    json.dumps(sweep.to_dict())


def test_attention_layer_small_input_powers():
    """Near-uniform attention (small c X): G_V ~ c, so (V,V) ~ c^2; G_Q ~ c^3 and d2F ~ c^5, with the
    residual R ~ -Target fixed, so (Q,Q) ~ c^5 (the functional part leads; the outer part is c^6)."""
    rng = np.random.default_rng(2)
    params = attention_layer()
    X, target = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    sweep = analysis.scale_sweep(X, target, params, scales=np.logspace(-4, -3, 4))
    assert sweep.exponents["W_V", "W_V"] == pytest.approx(2.0, abs=0.01)
    assert sweep.exponents["W_Q", "W_Q"] == pytest.approx(5.0, abs=0.01)
    assert sweep.exponents["W_Q", "W_V"] == pytest.approx(3.0, abs=0.01)  # d2F[V, Q] ~ c^3 times R
    assert sweep.claimed["W_Q", "W_Q"] == 6


def test_length_sweep_extends_the_same_sequence():
    params = attention_layer(seed=3)
    sweep = analysis.length_sweep(params, lengths=(3, 6), seed=4)
    rng = np.random.default_rng(4)
    X, target = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    H = bh.loss_hessian(X[:3], target[:3], params, layout="blocks")
    assert sweep.norms["W_K", "W_V"][0] == pytest.approx(np.linalg.norm(H["W_K", "W_V"], 2), rel=1e-12)
    assert sweep.values == [3.0, 6.0] and sweep.claimed["W_Q", "W_Q"] == -3


def test_bad_sweeps():
    params = attention_layer()
    X = np.ones((3, 4))
    with pytest.raises(ValueError, match="scales"):
        analysis.scale_sweep(X, X, params, scales=[1.0])
    with pytest.raises(ValueError, match="scales"):
        analysis.scale_sweep(X, X, params, scales=[1.0, -1.0])
    with pytest.raises(ValueError, match="lengths"):
        analysis.length_sweep(params, lengths=(4,))
