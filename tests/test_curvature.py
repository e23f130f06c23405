"""Curvature without the dense matrix, on hessian_operator: the exact diagonal and traces (from the
per-token factors: engine/diagonal.hpp), extreme eigenvalues through H v (eigsh) and the spectral
density by stochastic Lanczos quadrature (blockhess.spectrum), each against the dense Hessian,
itself tested against autograd in test_family.py and test_pooled.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import blockhess
import reference as ref
from blockhess import BlockParams, BlockSpec
from blockhess import spectrum

SPECS = {
    "paper": BlockSpec(),
    "post-everything-heads2": BlockSpec(norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                                        causal=True, eps=1e-3),
    "pre-everything-heads2": BlockSpec(norm_position="pre", norm_affine=True, heads=2, bias=True, out_proj=True,
                                       activation="gelu_tanh", causal=True, eps=1e-5),
    "pre-rmsnorm-affine-silu": BlockSpec(norm_position="pre", norm="rmsnorm", norm_affine=True, activation="silu",
                                         eps=1e-6),
}
L, D, D_FF, CLASSES = 4, 6, 7, 3


def _case(rng, spec, B, loss, dtype=np.float64):
    d_k = 3 if spec.heads == 1 else 2
    d_v = 2 if spec.out_proj else None
    params = BlockParams.random(spec, d=D, d_k=d_k, d_ff=D_FF, d_v=d_v, seed=int(rng.integers(1 << 30)), dtype=dtype)
    shape = (L, D) if B is None else (B, L, D)
    X = rng.standard_normal(shape).astype(dtype)
    target = ref.random_target(rng, loss, shape, D, CLASSES, dtype)
    head = None
    if loss == "pooled_cross_entropy":
        head = (rng.standard_normal((D, CLASSES)).astype(dtype), rng.standard_normal(CLASSES).astype(dtype))
    return X, target, params, dict(loss=loss, head=head)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy"])
@pytest.mark.parametrize("B", [None, 3])
def test_diagonal_and_traces_are_exact(rng, name, loss, B):
    X, target, params, kw = _case(rng, SPECS[name], B, loss)
    for part in ("full", "outer", "functional"):
        H = blockhess.loss_hessian(X, target, params, part=part, **kw)
        op = blockhess.hessian_operator(X, target, params, part=part, **kw)
        diag = op.diagonal()
        assert diag.shape == (params.size,) and diag.dtype == np.float64
        assert np.max(np.abs(diag - np.diag(H))) <= 1e-12 * np.abs(np.diag(H)).max()
        assert op.trace() == pytest.approx(np.trace(H), rel=1e-12, abs=1e-14 * np.abs(H).max())
        by_block = op.trace(by_block=True)
        assert list(by_block) == [(n, n) for n in params.names]
        for n, s in params.slices().items():
            assert by_block[n, n] == pytest.approx(np.trace(H[s, s]), rel=1e-12, abs=1e-14 * np.abs(H).max())


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("loss", ["mse", "pooled_cross_entropy"])
def test_frobenius_norms_are_exact(rng, name, loss):
    X, target, params, kw = _case(rng, SPECS[name], 2, loss)
    for part in ("full", "functional"):
        H = blockhess.loss_hessian(X, target, params, part=part, layout="blocks", **kw)
        dense = blockhess.loss_hessian(X, target, params, part=part, **kw)
        op = blockhess.hessian_operator(X, target, params, part=part, **kw)
        assert op.frobenius_norm() == pytest.approx(np.linalg.norm(dense), rel=1e-12)
        by_block = op.frobenius_norm(by_block=True)
        assert list(by_block) == list(H)
        for key, block in H.items():
            assert by_block[key] == pytest.approx(np.linalg.norm(block), rel=1e-12, abs=1e-14 * np.abs(dense).max())
    full = blockhess.loss_hessian(X, target, params, layout="blocks", **kw)
    one = blockhess.hessian_operator(X, target, params, wrt=("W_V",), **kw).frobenius_norm()
    assert one == pytest.approx(np.linalg.norm(full["W_V", "W_V"]), rel=1e-12)


def test_frobenius_norm_of_the_dataset_operator(rng):
    X, target, params, kw = _case(rng, SPECS["pre-everything-heads2"], 4, "mse")
    batches = [(X[:2], target[:2]), (X[2:], target[2:])]
    data = blockhess.dataset_hessian_operator(batches, params, loss="mse")
    assert data.frobenius_norm() == pytest.approx(np.linalg.norm(blockhess.loss_hessian(X, target, params)), rel=1e-12)


@pytest.mark.parametrize("loss", ["mse", "pooled_cross_entropy"])
def test_diagonal_of_a_selection_is_the_sub_diagonal(rng, loss):
    X, target, params, kw = _case(rng, SPECS["pre-everything-heads2"], 2, loss)
    full = np.diag(blockhess.loss_hessian(X, target, params, **kw))
    where = params.slices()
    for wrt in (("W_Q",), ("b_K", "W_O", "gamma_1"), ("W_V", "beta_2")):
        diag = blockhess.hessian_operator(X, target, params, wrt=wrt, **kw).diagonal()
        expected = np.concatenate([full[where[n]] for n in wrt])
        np.testing.assert_allclose(diag, expected, rtol=0, atol=1e-13 * np.abs(full).max())


def test_diagonal_float32_is_close_to_float64(rng):
    spec = SPECS["post-everything-heads2"]
    X, target, params, kw = _case(rng, spec, 2, "cross_entropy")
    p32 = BlockParams.from_arrays(spec, {n: params[n].astype(np.float32) for n in params.names})
    d64 = blockhess.hessian_operator(X, target, params, **kw).diagonal()
    d32 = blockhess.hessian_operator(X.astype(np.float32), target, p32, **kw).diagonal()
    assert d32.dtype == np.float32 and ref.rel_err(d32, d64) <= 1e-4


def test_diagonal_is_cached_and_read_only(rng):
    X, target, params, kw = _case(rng, SPECS["paper"], None, "mse")
    op = blockhess.hessian_operator(X, target, params, **kw)
    assert op.diagonal() is op.diagonal()
    with pytest.raises(ValueError):
        op.diagonal()[0] = 1.0


@pytest.mark.parametrize("name", ["paper", "pre-everything-heads2"])
def test_eigsh_finds_the_extreme_eigenvalues(rng, name):
    X, target, params, kw = _case(rng, SPECS[name], 2, "cross_entropy")
    H = blockhess.loss_hessian(X, target, params, **kw)
    exact = np.linalg.eigvalsh(H)
    op = blockhess.hessian_operator(X, target, params, **kw)
    scale = np.abs(exact).max()
    top, vectors = op.eigsh(k=5, which="LA")
    assert np.max(np.abs(top - exact[-5:])) <= 1e-8 * scale
    assert np.max(np.abs(H @ vectors - vectors * top)) <= 1e-7 * scale
    bottom = op.eigsh(k=5, which="SA", return_eigenvectors=False)
    assert np.max(np.abs(bottom - exact[:5])) <= 1e-8 * scale
    assert bottom[0] < 0  # the functional part makes the block's loss non-convex here
    largest = op.eigsh(k=3, which="LM", return_eigenvectors=False)
    magnitudes = np.sort(np.abs(exact))[-3:]
    assert np.max(np.abs(np.sort(np.abs(largest)) - magnitudes)) <= 1e-8 * scale
    # Per block: the operator restricted to one parameter is that diagonal block of H.
    s = params.slices()["W_V"]
    block_top = blockhess.hessian_operator(X, target, params, wrt=("W_V",), **kw).eigsh(k=2, return_eigenvectors=False)
    assert np.max(np.abs(block_top - np.linalg.eigvalsh(H[s, s])[-2:])) <= 1e-8 * scale


def test_eigsh_keeps_fewer_lanczos_vectors_where_scipys_basis_would_not_fit_the_budget(rng, monkeypatch):
    """A whole model's P: ARPACK's default 20 vectors may exceed the budget; eigsh keeps as many as
    fit (at least 2k + 1, in the operator's dtype) and finds the same eigenvalue with more restarts."""
    from blockhess import spectrum

    P = 10**6
    assert spectrum.arpack_basis(P, 1) == 20
    with blockhess.memory_budget(8 * 6 * (P + 28)):
        assert spectrum.arpack_basis(P, 1) == 6 and spectrum.arpack_basis(P, 1, itemsize=4) == 12
        assert spectrum.arpack_basis(P, 4) == 9  # never below 2k + 1
        assert spectrum.arpack_memory(P, 1) <= blockhess.get_memory_budget()
    # The fewest vectors (2k + 1) still give the exact top eigenvalue.
    X, target, params, kw = _case(rng, SPECS["paper"], 2, "cross_entropy")
    exact = np.linalg.eigvalsh(blockhess.loss_hessian(X, target, params, **kw))
    monkeypatch.setattr(spectrum, "arpack_basis", lambda P, k, itemsize=8: 2 * k + 1)
    top = blockhess.hessian_operator(X, target, params, **kw).eigsh(k=1, return_eigenvectors=False)
    assert abs(top[0] - exact[-1]) <= 1e-8 * np.abs(exact).max()


def test_eigsh_bad_arguments(rng):
    X, target, params, kw = _case(rng, SPECS["paper"], None, "mse")
    op = blockhess.hessian_operator(X, target, params, **kw)
    with pytest.raises(ValueError, match="which must be one of"):
        op.eigsh(which="BE")
    with pytest.raises(ValueError, match="k must be smaller"):
        op.eigsh(k=op.shape[0])
    with pytest.raises(ValueError, match="tol must be"):
        op.eigsh(tol=-1.0)


def test_spectral_density_integrates_to_one_and_matches_the_moments(rng):
    X, target, params, kw = _case(rng, SPECS["post-everything-heads2"], 2, "mse")
    H = blockhess.loss_hessian(X, target, params, **kw)
    P = H.shape[0]
    op = blockhess.hessian_operator(X, target, params, **kw)
    probes = 30
    sd = op.spectral_density(probes=probes, steps=40, grid=4000, seed=1)
    assert sd.density.min() >= 0 and sd.truncation < 1e-6
    assert np.trapezoid(sd.density, sd.grid) == pytest.approx(1.0, abs=1e-4)
    for m, A in ((1, H), (2, H @ H)):
        exact = np.trace(A) / P
        # The Hutchinson error of unit-length Rademacher probes: var = 2 (||A||_F^2 - sum A_ii^2) / P^2.
        std = math.sqrt(2 * (np.sum(A * A) - np.sum(np.diag(A) ** 2))) / P / math.sqrt(probes)
        assert abs(sd.moment(m) - exact) <= 5 * std
    # The broadened density's mean is the quadrature's first moment (a Gaussian keeps the mean).
    mean = np.trapezoid(sd.grid * sd.density, sd.grid)
    assert mean == pytest.approx(sd.moment(1), abs=1e-4 * np.abs(sd.grid).max())


def test_lanczos_quadrature_is_exact_for_low_degrees(rng):
    """For one probe, sum_k tau_k theta_k^m = v^T A^m v / |v|^2 for m <= 2 steps - 1."""
    A = rng.standard_normal((30, 30))
    A = A + A.T
    v = rng.choice((-1.0, 1.0), 30)
    theta, tau = spectrum.gauss_quadrature(*spectrum.lanczos(lambda x: A @ x, v, 4))
    assert tau.sum() == pytest.approx(1.0, abs=1e-14)
    for m in range(8):
        exact = v @ np.linalg.matrix_power(A, m) @ v / (v @ v)
        assert np.sum(tau * theta**m) == pytest.approx(exact, rel=1e-10, abs=1e-10)
    # Steps beyond the size stop on the invariant subspace: the nodes are then the eigenvalues.
    theta, _ = spectrum.gauss_quadrature(*spectrum.lanczos(lambda x: A @ x, v, 60))
    np.testing.assert_allclose(theta, np.linalg.eigvalsh(A), rtol=0, atol=1e-10 * np.abs(A).max())
