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
from blockhess.bounds import counterexamples
from blockhess.bounds.configurations import random_configuration
from blockhess.bounds._norms import block_norms

CONFIGURATIONS = 50


def configuration(i: int) -> dict:
    return random_configuration(i)


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
    J, H = ln_bounds.lemma4(counterexamples.e14_layernorm())
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


# ---- Thm 1 ----------------------------------------------------------------------------------------


def attention_layer(params: bh.BlockParams) -> bh.BlockParams:
    return bh.BlockParams.from_arrays(bh.BlockSpec(attention_only=True), {n: params[n] for n in ("W_Q", "W_K", "W_V")})


@pytest.mark.parametrize("i", range(CONFIGURATIONS))
def test_theorem1_corrected_holds(i):
    c = configuration(i)
    found = bounds.theorem1(c["X"], c["target"], attention_layer(c["params"]))
    assert [b.quantity for b in found][:6] == ["Thm 1: ||H(V,V)||", "Thm 1: ||H(Q,Q)||", "Thm 1: ||H(Q,V)||",
                                               "Thm 1: ||H(Q,K)||", "Thm 1: ||H(K,K)||", "Thm 1: ||H(K,V)||"]
    assert found[4].stated is None and found[5].stated is None  # the blocks Thm 1's max omits (E12)
    assert_corrected_hold(found)


def test_theorem1_exact_values_match_autograd():
    torch = pytest.importorskip("torch")
    from torch.func import hessian

    c = configuration(3)
    X, target, params = c["X"], c["target"], attention_layer(c["params"])
    W = [torch.tensor(np.asarray(params[n])) for n in ("W_Q", "W_K", "W_V")]
    sizes = [w.numel() for w in W]

    def loss(flat):
        WQ, WK, WV = (p.reshape(w.shape) for p, w in zip(flat.split(sizes), W))
        x = torch.tensor(X)
        A = torch.softmax(x @ WQ @ WK.T @ x.T / np.sqrt(WQ.shape[1]), dim=-1)
        return ((A @ x @ WV - torch.tensor(target)) ** 2).mean()

    H = hessian(loss)(torch.cat([w.reshape(-1) for w in W])).numpy()
    found = {b.quantity: b.exact for b in bounds.theorem1(X, target, params)}
    q, k, v = (slice(0, sizes[0]), slice(sizes[0], sizes[0] + sizes[1]), slice(sizes[0] + sizes[1], None))
    assert found["Thm 1: ||H(Q,K)||"] == pytest.approx(np.linalg.norm(H[q, k], 2), rel=1e-10)
    assert found["Thm 1: ||H(K,V)||"] == pytest.approx(np.linalg.norm(H[k, v], 2), rel=1e-10)
    assert found["Thm 1: M >= ||H||"] == pytest.approx(np.abs(np.linalg.eigvalsh(H)).max(), rel=1e-10)


def test_e11_softmax_jacobian_exceeds_uniform():
    """E11: ||dA/dT|| <= 1/L is uniform attention's value; a row of two keys at 1/2 reaches 1/2."""
    L = 6
    T = np.full((L, L), -30.0)
    T[:, :2] = 0.0  # every row: half on key 0, half on key 1
    norm = np.linalg.norm(bh.softmax_jacobian(T), 2)
    assert norm == pytest.approx(0.5, rel=1e-10)
    assert norm > 1 / L
    assert np.linalg.norm(bh.softmax_jacobian(np.zeros((L, L))), 2) == pytest.approx(1 / L)  # uniform
    rng = np.random.default_rng(0)  # never above 1/2 (Gershgorin), nor above the largest weight
    for scale in (0.1, 1.0, 5.0, 50.0):
        T = scale * rng.standard_normal((L, L))
        assert np.linalg.norm(bh.softmax_jacobian(T), 2) <= min(0.5, bh.softmax(T).max()) * (1 + 1e-12)


def test_e11_counterexample_breaks_intermediate_outer_QQ():
    """E11 at (L, d_V, d_K) = (9, 2, 1): the exact outer (Q,Q) block is 6.1x the appendix's 2/L^3
    bound; the corrected bound (1/(4L)) holds. Checked through theorem1 and, independently, from
    G_Q = attention_jacobian(wrt="W_Q")."""
    X, W_Q, W_K, W_V = counterexamples.e11_attention()
    params = bh.BlockParams.from_arrays(bh.BlockSpec(attention_only=True), {"W_Q": W_Q, "W_K": W_K, "W_V": W_V})
    (b,) = [b for b in bounds.theorem1(X, np.zeros_like(X), params) if "H_o(Q,Q)" in b.quantity]
    assert b.stated_holds is False and b.exact / b.stated > 6
    assert b.corrected_holds
    G = bh.attention_jacobian(X, W_Q, W_K, W_V, "W_Q")
    assert b.exact == pytest.approx(2 / (9 * 2) * np.linalg.norm(G, 2) ** 2, rel=1e-10)


def test_theorem1_refuses_other_models():
    c = configuration(1)
    with pytest.raises(ValueError, match="attention layer"):
        bounds.theorem1(c["X"], c["target"], c["params"])  # the whole block
    biased = bh.BlockParams.random(bh.BlockSpec(attention_only=True, bias=True), d=4, d_k=2)
    with pytest.raises(ValueError, match="paper's bounds"):
        bounds.theorem1(np.ones((3, 4)), np.ones((3, 4)), biased)
