"""blockhess._torch_reference, the PyTorch block every other test trusts, checked against
independent computations: the block and losses written again in NumPy from docs/derivation.md §2, finite
differences of its loss and gradient in float64, the Gauss-Newton identity, and the HVPs against
torch.func.hessian @ v."""

import subprocess
import sys

import numpy as np
import pytest
import reference as ref
import torch

from blockhess import _torch_reference as R

SHAPES = [(3, 4, 2, 5, None), (2, 3, 3, 4, 2)]  # (L, d, d_k, d_ff, batch)
LOSSES = ("mse", "cross_entropy")  # per token; the pooled head's loss is checked on its own below


def _np_layernorm(x, eps=0.0):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps)


def _np_block(X, WQ, WK, WV, W1, W2, eps):
    T = np.einsum("...id,dk,ek,...je->...ij", X, WQ, WK, X) / np.sqrt(WQ.shape[1])
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    Y = _np_layernorm(X + A @ X @ WV, eps)
    return _np_layernorm(np.maximum(Y @ W1, 0.0) @ W2 + Y, eps)


def _np_loss(Z, target, kind):
    if kind == "mse":
        return np.mean((Z - target) ** 2)
    logits = Z.reshape(-1, Z.shape[-1])
    top = logits.max(-1)
    log_norm = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    return np.mean(log_norm - logits[np.arange(len(logits)), target.reshape(-1)])


def _problem(rng, L, d, dk, dff, B, kind):
    X, W, target, classes = ref.random_block(rng, L, d, dk, dff, B=B)
    return X, (target if kind == "mse" else classes), W


def test_layernorm_matches_the_formula(rng):
    x = rng.standard_normal((2, 3, 7))
    gamma, beta = rng.standard_normal(7), rng.standard_normal(7)
    for eps in (0.0, 1e-3):
        expected = _np_layernorm(x, eps) * gamma + beta
        got = R.layernorm(ref.t(x), eps, ref.t(gamma), ref.t(beta))
        assert ref.rel_err(got.numpy(), expected) <= 1e-14
        fused = R.layernorm(ref.t(x), eps, ref.t(gamma), ref.t(beta), fused=True)
        assert ref.rel_err(fused.numpy(), expected) <= 1e-13
    assert ref.rel_err(R.layernorm(ref.t(x)).numpy(), _np_layernorm(x)) <= 1e-14


@pytest.mark.parametrize("B", [None, 3])
def test_pooled_loss_matches_numpy_and_finite_differences(rng, B):
    """mean over samples of the cross-entropy of mean_t(Z_t) W_C + b_C, written again in NumPy; its
    gradient in Z against central differences."""
    lead = (B,) if B is not None else ()
    Z = rng.standard_normal((*lead, 4, 5))
    W_C, b_C = rng.standard_normal((5, 3)), rng.standard_normal(3)
    classes = rng.integers(0, 3, lead)
    logits = (Z.mean(-2) @ W_C + b_C).reshape(-1, 3)
    log_norm = np.log(np.exp(logits).sum(-1))
    expected = np.mean(log_norm - logits[np.arange(len(logits)), classes.reshape(-1)])
    head, t = (ref.t(W_C), ref.t(b_C)), torch.as_tensor(classes)
    assert abs(R.loss(ref.t(Z), t, "pooled_cross_entropy", head).item() - expected) <= 1e-14
    g = torch.func.grad(lambda z: R.loss(z, t, "pooled_cross_entropy", head))(ref.t(Z)).numpy()
    fd = ref.finite_difference_jacobian(lambda z: np.array([R.loss(ref.t(z), t, "pooled_cross_entropy", head).item()]),
                                        Z).reshape(Z.shape)
    assert ref.rel_err(g, fd) <= 1e-8


@pytest.mark.parametrize("L,d,dk,dff,B", SHAPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_block_and_loss_match_numpy(rng, L, d, dk, dff, B, kind):
    X, target, W = _problem(rng, L, d, dk, dff, B, kind)
    Z_np = _np_block(X, *W, eps=1e-3)
    Xt, tt, Wt = R.as_problem(X, target, W, kind)
    Z = R.block(Xt, *Wt, eps=1e-3)
    assert ref.rel_err(Z.numpy(), Z_np) <= 1e-13
    assert ref.rel_err(R.block(Xt, *Wt, eps=1e-3, fused=True).numpy(), Z_np) <= 1e-13
    assert abs(R.loss(Z, tt, kind).item() - _np_loss(Z_np, target, kind)) <= 1e-13
    if B is not None:  # the batch loss is the mean of the per-sample losses
        per_sample = [R.loss(R.block(Xt[b], *Wt, eps=1e-3), tt[b], kind).item() for b in range(B)]
        assert abs(R.loss(Z, tt, kind).item() - np.mean(per_sample)) <= 1e-14


@pytest.mark.parametrize("L,d,dk,dff,B", SHAPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_gradient_and_hessian_match_finite_differences(rng, L, d, dk, dff, B, kind):
    X, target, W = _problem(rng, L, d, dk, dff, B, kind)
    Xt, tt, Wt = R.as_problem(X, target, W, kind)
    v0 = R.flatten(Wt).numpy()
    loss_of = R.loss_of_flat(Xt, tt, [w.shape for w in Wt], kind, 1e-3)

    def value(v):
        return np.array([loss_of(ref.t(v)).item()])

    def gradient(v):
        return R.loss_gradient(Xt, tt, R.unflatten(ref.t(v), [w.shape for w in Wt]), kind, 1e-3).numpy()

    g = gradient(v0)
    assert ref.rel_err(g, ref.finite_difference_jacobian(value, v0, h=1e-5)[0]) <= 1e-8
    H = R.loss_hessian(Xt, tt, Wt, kind, 1e-3).numpy()
    assert ref.rel_err(H, ref.finite_difference_jacobian(gradient, v0, h=1e-5)) <= 1e-7
    np.testing.assert_allclose(H, H.T, rtol=0, atol=1e-13 * np.abs(H).max())


@pytest.mark.parametrize("L,d,dk,dff,B", SHAPES)
@pytest.mark.parametrize("kind", LOSSES)
def test_outer_and_functional_parts(rng, L, d, dk, dff, B, kind):
    X, target, W = _problem(rng, L, d, dk, dff, B, kind)
    parts = {p: R.loss_hessian(X, target, W, kind, 1e-3, part=p).numpy() for p in R.PARTS}
    assert ref.rel_err(parts["outer"] + parts["functional"], parts["full"]) <= 1e-14
    # the Gauss-Newton part is J^T H_l J with H_l positive semi-definite (2/N I for MSE)
    assert np.linalg.eigvalsh(parts["outer"]).min() >= -1e-12 * np.abs(parts["outer"]).max()
    if kind == "mse":
        Xt, _, Wt = R.as_problem(X, target, W, kind)
        J = ref.jacobian(lambda v: R.block(Xt, *R.unflatten(v, [w.shape for w in Wt]), eps=1e-3), R.flatten(Wt))
        assert ref.rel_err(parts["outer"], 2 / X.size * J.T @ J) <= 1e-13


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("part", R.PARTS)
def test_subsets_are_submatrices(rng, kind, part):
    X, target, W = _problem(rng, 3, 4, 2, 5, 2, kind)
    full = R.loss_hessian(X, target, W, kind, 1e-3, part=part).numpy()
    bounds = np.cumsum([0, *(w.size for w in W)])
    rows = np.r_[bounds[0]:bounds[1], bounds[2]:bounds[3]]  # W_Q, W_V
    sub = R.loss_hessian(X, target, W, kind, 1e-3, part=part, wrt=("W_V", "W_Q")).numpy()
    assert ref.rel_err(sub, full[np.ix_(rows, rows)]) <= 1e-13
    grad = R.loss_gradient(X, target, W, kind, 1e-3, wrt=("W_V", "W_Q")).numpy()
    assert ref.rel_err(grad, R.loss_gradient(X, target, W, kind, 1e-3).numpy()[rows]) <= 1e-14


@pytest.mark.parametrize("L,d,dk,dff,B", SHAPES)
@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("part", R.PARTS)
def test_hvp_matches_hessian_times_vector(rng, L, d, dk, dff, B, kind, part):
    X, target, W = _problem(rng, L, d, dk, dff, B, kind)
    for wrt in (None, ("W_K", "W_2")):
        H = R.loss_hessian(X, target, W, kind, 1e-3, part=part, wrt=wrt)
        v = ref.t(rng.standard_normal(H.shape[0]))
        hv = R.loss_hvp(X, target, W, v, kind, 1e-3, part=part, wrt=wrt)
        assert ref.rel_err(hv.numpy(), (H @ v).numpy()) <= 1e-12, wrt


def test_float32_stays_float32(rng):
    X, target, W = _problem(rng, 3, 4, 2, 5, None, "mse")
    X32, t32, W32 = X.astype(np.float32), target.astype(np.float32), [w.astype(np.float32) for w in W]
    H32 = R.loss_hessian(X32, t32, W32, "mse", 1e-3)
    hv32 = R.loss_hvp(X32, t32, W32, np.ones(H32.shape[0], np.float32), "mse", 1e-3)
    assert H32.dtype == hv32.dtype == torch.float32
    assert ref.rel_err(H32.numpy(), R.loss_hessian(X, target, W, "mse", 1e-3).numpy()) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
def test_cuda_tensors_stay_on_the_gpu(rng):
    X, target, W = _problem(rng, 3, 4, 2, 5, 2, "cross_entropy")
    Xc, tc, Wc = R.as_problem(X, target, W, "cross_entropy", device="cuda")
    for part in R.PARTS:
        H = R.loss_hessian(Xc, tc, Wc, "cross_entropy", 1e-3, part=part)
        hv = R.loss_hvp(Xc, tc, Wc, torch.ones(H.shape[0], device="cuda", dtype=H.dtype), "cross_entropy", 1e-3, part=part)
        assert H.is_cuda and hv.is_cuda
        H_cpu = R.loss_hessian(X, target, W, "cross_entropy", 1e-3, part=part).numpy()
        assert ref.rel_err(H.cpu().numpy(), H_cpu) <= 1e-12


def test_bad_arguments(rng):
    X, target, W = _problem(rng, 3, 4, 2, 5, None, "mse")
    with pytest.raises(ValueError, match="part"):
        R.loss_hessian(X, target, W, "mse", part="gauss-newton")
    with pytest.raises(ValueError, match="part"):
        R.loss_hvp(X, target, W, np.ones(1), "mse", part="gauss-newton")
    with pytest.raises(ValueError, match="kind"):
        R.loss_gradient(X, target, W, "hinge")
    for wrt in ("W_Q", (), ("W_Q", "W_Q"), ("W_X",)):
        with pytest.raises(ValueError, match="wrt"):
            R.loss_gradient(X, target, W, "mse", wrt=wrt)


def test_import_blockhess_does_not_import_torch_or_the_reference():
    code = ("import sys, blockhess; "
            "assert 'blockhess._torch_reference' not in sys.modules and 'torch' not in sys.modules, "
            "[m for m in sys.modules if 'torch' in m]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_reference_has_every_activation_of_the_core_registry():
    """activation.hpp's registry (blockhess._core.activations) names what BlockSpec accepts; the
    reference written from the definitions must have each (a new one is added to both)."""
    from blockhess import _core
    from blockhess import _torch_reference as torch_reference
    from blockhess.spec import activation_names

    names = activation_names()
    assert names == tuple(_core.activations) and len(set(names)) == len(names) >= 4
    assert set(torch_reference._ACTIVATIONS) == set(names)
