"""blockhess.bounds: every corrected bound holds on random configurations (shapes, weight scales
0.1-10, eps 0 and > 0, peaked attention on purpose), the exact values are right (against autograd),
and the paper's known failures show (errata E11, E14, E17)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import blockhess as bh
from blockhess import bounds
from blockhess.bounds import layernorm as ln_bounds
from blockhess.bounds._norms import block_norms

CONFIGURATIONS = 50


def configuration(i: int) -> dict:
    """The i-th random configuration: every 5th has peaked attention (large logits) on purpose."""
    rng = np.random.default_rng(1000 + i)
    L, d, d_k, d_ff = (int(rng.integers(a, b)) for a, b in ((2, 8), (3, 6), (1, 4), (2, 8)))
    scale = float(10 ** rng.uniform(-1, 1))
    X = rng.standard_normal((L, d))
    params = bh.BlockParams.random(d=d, d_k=d_k, d_ff=d_ff, seed=i)
    W = [scale * np.asarray(w) for w in params.arrays]
    if i % 5 == 0:  # peaked: logits of order 10-100, most rows' softmax on one or two keys
        X, W[0] = 3 * X, 10 * W[0] / max(scale, 1.0)
    return dict(X=X, target=rng.standard_normal((L, d)), params=bh.BlockParams(*W),
                eps=0.0 if i % 2 == 0 else 0.05, scale=scale)


def assert_corrected_hold(found: list[bounds.Bound]) -> None:
    for b in found:
        assert np.isfinite(b.exact) and b.exact >= 0, b
        assert b.corrected_holds, f"{b.quantity}: exact {b.exact:.6g} > corrected {b.corrected:.6g}"


# ---- Lemma 4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", range(CONFIGURATIONS))
def test_lemma4_corrected_holds(i):
    c = configuration(i)
    rng = np.random.default_rng(i)
    X = c["X"] * c["scale"] + rng.standard_normal((c["X"].shape[0], 1))  # scaled and shifted rows
    found = ln_bounds.lemma4(X, eps=c["eps"])
    assert_corrected_hold(found)
    if c["eps"] == 0:  # exact there, for n >= 3 (the module docstring's derivation)
        for b in found:
            assert b.exact == pytest.approx(b.corrected, rel=1e-10, abs=1e-300) or X.shape[1] < 5


def test_lemma4_exact_norms_match_autograd():
    torch = pytest.importorskip("torch")
    from blockhess import _torch_reference as ref

    X = np.random.default_rng(3).standard_normal((3, 5))
    for eps in (0.0, 0.3):
        f = lambda x: ref.layernorm(x, eps).reshape(-1)  # noqa: E731
        x = torch.tensor(X, dtype=torch.float64)
        J = torch.autograd.functional.jacobian(f, x).reshape(15, 15)
        H = torch.autograd.functional.jacobian(lambda x: torch.autograd.functional.jacobian(f, x, create_graph=True)
                                               .reshape(15, 15), x).reshape(15 * 15, 15)
        exact_J, exact_H = ln_bounds.exact_norms(X, eps)
        assert exact_J == pytest.approx(float(torch.linalg.matrix_norm(J, 2)), rel=1e-12)
        assert exact_H == pytest.approx(float(torch.linalg.matrix_norm(H, 2)), rel=1e-12)


def test_lemma4_row_norm_sigma_fails():
    """E14: with sigma_min printed as the smallest centred row norm, both bounds of Lemma 4 fail
    (this input: 1.71x and 1.97x); with the row std (the proof's) they hold."""
    rng = np.random.default_rng(37)
    m, n = rng.integers(2, 8), rng.integers(3, 9)
    X = rng.standard_normal((m, n)) * 10 ** rng.uniform(-1, 1)
    J, H = ln_bounds.lemma4(X)
    assert J.stated_holds is False and J.exact / J.stated > 1.5
    assert H.stated_holds is False and H.exact / H.stated > 1.5
    assert J.exact <= J.extra["stated_row_std"] and H.exact <= H.extra["stated_row_std"]


def test_lemma4_stated_hessian_bound_is_not_homogeneous():
    """E14: the exact ||H_LN|| scales as c^-2 with the input (eps = 0); the stated bound does not."""
    X = np.random.default_rng(5).standard_normal((4, 6))
    ratios_exact, ratios_stated = [], []
    for c in (1.0, 1000.0):
        H = ln_bounds.lemma4(c * X)[1]
        ratios_exact.append(H.exact * c**2)
        ratios_stated.append(H.extra["stated_row_std"] * c**2)
    assert ratios_exact[0] == pytest.approx(ratios_exact[1], rel=1e-10)
    assert ratios_stated[1] > 10 * ratios_stated[0]  # its middle term grows as c


def test_lemma4_hessian_constant():
    assert ln_bounds.hessian_constant(16) == pytest.approx(14.0)  # n - 2 at eps = 0, n >= 5
    grid = np.linspace(0, 1, 100001)
    for n in range(1, 12):
        sampled = (grid * np.maximum(n + 7 + 9 * grid**2 - 18 * grid, 2)).max()
        assert sampled <= ln_bounds.hessian_constant(n) * (1 + 1e-12)
        assert sampled >= ln_bounds.hessian_constant(n) * (1 - 1e-6)


def test_lemma4_bad_input():
    with pytest.raises(ValueError, match="positive variance"):
        ln_bounds.lemma4(np.ones((3, 4)))
    with pytest.raises(ValueError, match="eps"):
        ln_bounds.lemma4(np.eye(3), eps=-1.0)


# ---- Proposition 10 and Thm 6 ---------------------------------------------------------------------


@pytest.mark.parametrize("i", range(CONFIGURATIONS))
def test_proposition10_and_theorem6_corrected_hold(i):
    c = configuration(i)
    found = bounds.proposition10(c["X"], c["params"], eps=c["eps"])
    found += bounds.theorem6(c["X"], c["target"], c["params"], eps=c["eps"])
    assert len(found) == 3 + 15 + 1
    assert_corrected_hold(found)
    for b in found[:3]:
        assert b.stated_holds  # Prop 10 holds as stated


def test_theorem6_batch_and_records():
    rng = np.random.default_rng(0)
    params = bh.BlockParams.random(d=4, d_k=2, d_ff=6, seed=1)
    X, target = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 5, 4))
    found = bounds.theorem6(X, target, params)
    assert_corrected_hold(found)
    H = bh.loss_hessian(X, target, params, layout="blocks")
    assert found[0].quantity == "Thm 6: ||H(Q,Q)||"
    assert found[0].exact == pytest.approx(np.linalg.norm(H["W_Q", "W_Q"], 2), rel=1e-12)
    record = json.loads(json.dumps(found[-1].to_dict()))
    assert set(record) >= {"quantity", "exact", "stated", "corrected", "erratum", "tightness"}
    with pytest.raises(ValueError, match="paper's block"):
        bounds.theorem6(X, target, bh.BlockParams.random(bh.BlockSpec(bias=True), d=4, d_k=2, d_ff=6))


def test_block_norms_by_power_iteration_match_dense():
    rng = np.random.default_rng(1)
    params = bh.BlockParams.random(d=4, d_k=2, d_ff=5, seed=2)
    X, target = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    dense = block_norms(X, target, params, method="dense")
    power = block_norms(X, target, params, method="power", iterations=2000)
    for key, value in dense.items():
        assert power[key] == pytest.approx(value, rel=1e-6), key


def test_exact_block_norms_match_autograd():
    torch = pytest.importorskip("torch")
    from blockhess import _torch_reference as ref

    rng = np.random.default_rng(2)
    params = bh.BlockParams.random(d=4, d_k=3, d_ff=5, seed=3)
    X, target = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    H = ref.loss_hessian(torch.tensor(X), torch.tensor(target), [torch.tensor(w) for w in params.arrays], "mse")
    norms = block_norms(X, target, params)
    assert norms["all", "all"] == pytest.approx(float(torch.linalg.matrix_norm(H, 2)), rel=1e-10)
    s = params.slices()
    assert norms["W_Q", "W_V"] == pytest.approx(float(torch.linalg.matrix_norm(H[s["W_Q"], s["W_V"]], 2)), rel=1e-10)


# ---- Thm 7 ----------------------------------------------------------------------------------------


def test_theorem7_rhs():
    rhs = bounds.theorem7_rhs(np.array([1, 3]), 2.0, M=4.0, distance=0.5)
    np.testing.assert_allclose(rhs["stated"], [(4 + 1) / 2, (4 + 1) / 4])
    np.testing.assert_allclose(rhs["corrected"], [(2 + 1) / 2, (2 + 1) / 4])
    with pytest.raises(ValueError, match="k counts"):
        bounds.theorem7_rhs(0, 1.0)
    with pytest.raises(ValueError, match="loss_bound"):
        bounds.theorem7_rhs(1, -1.0)


def test_theorem7_constant_2L_is_L():
    """E17: |l_{k+1} - L_k| <= Lmax, not 2 Lmax. Zero losses then one at Lmax reach it."""
    losses = np.zeros(20)
    losses[-1] = 3.0
    k, differences = bounds.running_differences(losses)
    rhs = bounds.theorem7_rhs(k, 3.0)
    assert np.all(differences <= rhs["corrected"] * (1 + 1e-12))
    assert differences[-1] == pytest.approx(rhs["corrected"][-1], rel=1e-12)
    assert differences[-1] == pytest.approx(rhs["stated"][-1] / 2, rel=1e-12)


def test_theorem7_on_the_block():
    """The quadratic model of Thm 7 along a displacement d, with M the largest exact per-sample
    ||H_i|| and the exact curvatures 1/2 d^T H_i d: the corrected bound holds."""
    rng = np.random.default_rng(4)
    params = bh.BlockParams.random(d=4, d_k=2, d_ff=5, seed=5)
    X, target = rng.standard_normal((12, 5, 4)), rng.standard_normal((12, 5, 4))
    d = rng.standard_normal(params.size)
    d *= 0.3 / np.linalg.norm(d)
    losses, curvatures, norms = [], [], []
    for x, t in zip(X, target):
        H = bh.loss_hessian(x, t, params)
        losses.append(bh.loss_value(x, t, params))
        curvatures.append(0.5 * d @ H @ d)
        norms.append(np.abs(np.linalg.eigvalsh(H)).max())
    b = bounds.theorem7(losses, curvatures, M=max(norms), distance=0.3)
    assert b.corrected_holds and b.stated_holds and b.stated > b.corrected
