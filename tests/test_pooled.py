"""loss="pooled_cross_entropy", the paper's ViT classifier head: logits = mean over tokens of Z times
W_C plus b_C, one class per sample. Its Hessian with respect to Z couples every pair of tokens of a
sample, so its outer part is assembled from token-summed Jacobians (assemble.hpp's accumulate_pooled)
rather than per-token sites. Checked against the torch reference written from the definition
(blockhess._torch_reference.loss), torch.func.hessian and an autograd Gauss-Newton (float64, 1e-10),
and against central differences of the closed-form gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import blockhess
import reference as ref
from blockhess import BlockParams, BlockSpec
from blockhess import _torch_reference as torch_reference

SPECS = {
    "paper": BlockSpec(),
    "post-everything-heads2": BlockSpec(norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                                        causal=True, eps=1e-3),
    "pre-everything-heads2": BlockSpec(norm_position="pre", norm_affine=True, heads=2, bias=True, out_proj=True,
                                       activation="gelu_tanh", causal=True, eps=1e-5),
    "pre-rmsnorm-affine": BlockSpec(norm_position="pre", norm="rmsnorm", norm_affine=True, eps=1e-6),
}
L, D, D_FF, CLASSES = 4, 6, 7, 3


def _case(rng, spec, B, dtype=np.float64):
    d_k = 3 if spec.heads == 1 else 2
    d_v = 2 if spec.out_proj else None
    params = BlockParams.random(spec, d=D, d_k=d_k, d_ff=D_FF, d_v=d_v, seed=int(rng.integers(1 << 30)), dtype=dtype)
    X = rng.standard_normal((L, D) if B is None else (B, L, D)).astype(dtype)
    target = rng.integers(0, CLASSES, () if B is None else (B,))
    head = (rng.standard_normal((D, CLASSES)).astype(dtype), 0.3 * rng.standard_normal(CLASSES).astype(dtype))
    return X, target, params, head


def _torch_loss(X, target, params, head):
    """The pooled loss as a function of the flat parameter vector, that vector, and Z of it."""
    output_of = torch_reference.family_of_flat(ref.t(X), params.spec, params.names, params.shapes)
    t = torch.as_tensor(target)
    torch_head = tuple(ref.t(a) for a in head)
    return (lambda v: torch_reference.loss(output_of(v), t, "pooled_cross_entropy", torch_head),
            ref.t(params.flatten()), output_of)


def _gauss_newton(X, target, params, head):
    f, v, output_of = _torch_loss(X, target, params, head)
    Z = output_of(v)
    J = torch.func.jacrev(output_of)(v).reshape(Z.numel(), -1)
    t, torch_head = torch.as_tensor(target), tuple(ref.t(a) for a in head)
    H_loss = torch.func.hessian(
        lambda z: torch_reference.loss(z.reshape(Z.shape), t, "pooled_cross_entropy", torch_head))(Z.reshape(-1))
    return (J.T @ H_loss @ J).numpy()


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("B", [None, 3])
def test_pooled_matches_autograd(rng, name, B):
    X, target, params, head = _case(rng, SPECS[name], B)
    f, v, _ = _torch_loss(X, target, params, head)
    kw = dict(loss="pooled_cross_entropy", head=head)
    assert abs(blockhess.loss_value(X, target, params, **kw) - float(f(v))) <= 1e-13 * abs(float(f(v)))
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, **kw), torch.func.grad(f)(v).numpy()) <= 1e-11
    H = blockhess.loss_hessian(X, target, params, **kw)
    assert ref.rel_err(H, torch.func.hessian(f)(v).numpy()) <= 1e-10
    assert np.array_equal(H, H.T)
    outer = blockhess.loss_hessian(X, target, params, part="outer", **kw)
    functional = blockhess.loss_hessian(X, target, params, part="functional", **kw)
    assert np.array_equal(outer, outer.T)
    assert ref.rel_err(outer, _gauss_newton(X, target, params, head)) <= 1e-10
    assert ref.rel_err(outer + functional, H) <= 1e-12
    # The Gauss-Newton part of a cross-entropy is positive semi-definite.
    assert np.linalg.eigvalsh(outer).min() >= -1e-12 * np.abs(outer).max()
    V = rng.standard_normal((params.size, 2))
    for part, dense in (("full", H), ("outer", outer), ("functional", functional)):
        assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, part=part, **kw), dense @ V) <= 1e-12
        op = blockhess.hessian_operator(X, target, params, part=part, **kw)
        assert ref.rel_err(op @ V[:, 0], dense @ V[:, 0]) <= 1e-12
        assert op.loss_value == pytest.approx(float(f(v)), rel=1e-13)


def test_pooled_gradient_against_central_differences(rng):
    X, target, params, head = _case(rng, SPECS["post-everything-heads2"], 2)
    kw = dict(loss="pooled_cross_entropy", head=head)
    g = blockhess.loss_gradient(X, target, params, **kw)
    H = blockhess.loss_hessian(X, target, params, **kw)
    flat, h = params.flatten(), 1e-5
    for k in rng.choice(params.size, 8, replace=False):
        e = np.zeros_like(flat)
        e[k] = h
        up, down = BlockParams.unflatten(flat + e, params), BlockParams.unflatten(flat - e, params)
        fd_value = (blockhess.loss_value(X, target, up, **kw) - blockhess.loss_value(X, target, down, **kw)) / (2 * h)
        assert fd_value == pytest.approx(g[k], rel=1e-6, abs=1e-9)
        fd_row = (blockhess.loss_gradient(X, target, up, **kw) - blockhess.loss_gradient(X, target, down, **kw)) / (2 * h)
        np.testing.assert_allclose(fd_row, H[k], rtol=0, atol=1e-6 * np.abs(H).max())


def test_pooled_wrt_subsets_are_sub_blocks(rng):
    X, target, params, head = _case(rng, SPECS["pre-everything-heads2"], 3)
    kw = dict(loss="pooled_cross_entropy", head=head)
    where = params.slices()
    for part in ("full", "outer"):
        H = blockhess.loss_hessian(X, target, params, part=part, **kw)
        for wrt in (("W_K",), ("b_Q", "W_O", "gamma_2"), ("W_Q", "b_K", "W_2")):
            sub = blockhess.loss_hessian(X, target, params, part=part, wrt=wrt, **kw)
            rows = np.concatenate([np.arange(where[n].start, where[n].stop) for n in wrt])
            np.testing.assert_allclose(sub, H[np.ix_(rows, rows)], rtol=0, atol=1e-13 * np.abs(H).max())
    blocks = blockhess.loss_hessian(X, target, params, layout="blocks", **kw)
    assert blocks["W_1", "W_2"].shape == (params["W_1"].size, params["W_2"].size)


def test_pooled_float32_is_close_to_float64(rng):
    spec = SPECS["post-everything-heads2"]
    X, target, params, head = _case(rng, spec, 2)
    p32 = BlockParams.from_arrays(spec, {n: params[n].astype(np.float32) for n in params.names})
    head32 = tuple(a.astype(np.float32) for a in head)
    H64 = blockhess.loss_hessian(X, target, params, loss="pooled_cross_entropy", head=head)
    H32 = blockhess.loss_hessian(X.astype(np.float32), target, p32, loss="pooled_cross_entropy", head=head32)
    assert H32.dtype == np.float32
    assert ref.rel_err(H32, H64) <= 1e-4
    # A float64 head promotes the float32 block to float64, like every other float argument.
    assert blockhess.loss_gradient(X.astype(np.float32), target, p32, loss="pooled_cross_entropy",
                                   head=head).dtype == np.float64


def test_pooled_takes_torch_tensors(rng):
    X, target, params, head = _case(rng, SPECS["paper"], 2)
    H = blockhess.loss_hessian(X, target, params, loss="pooled_cross_entropy", head=head)
    H_t = blockhess.loss_hessian(torch.as_tensor(X), torch.as_tensor(target), params, loss="pooled_cross_entropy",
                                 head=tuple(torch.as_tensor(a) for a in head))
    assert isinstance(H_t, torch.Tensor)
    np.testing.assert_array_equal(H_t.numpy(), H)


def test_pooled_bad_inputs_are_named(rng):
    X, target, params, head = _case(rng, SPECS["paper"], 2)
    kw = dict(loss="pooled_cross_entropy")
    with pytest.raises(TypeError, match=r"head=\(W_C, b_C\)"):
        blockhess.loss_gradient(X, target, params, **kw)
    with pytest.raises(ValueError, match="pooled_cross_entropy' only"):
        blockhess.loss_gradient(X, rng.integers(0, D, (2, L)), params, loss="cross_entropy", head=head)
    with pytest.raises(ValueError, match=r"target must have shape \(2,\) \(one class per sample\)"):
        blockhess.loss_gradient(X, rng.integers(0, CLASSES, (2, L)), params, head=head, **kw)
    with pytest.raises(ValueError, match=r"class index 3 is out of range: classes must lie in \[0, 3\)"):
        blockhess.loss_hessian(X, np.array([0, 3]), params, head=head, **kw)
    with pytest.raises(TypeError, match="integer class indices"):
        blockhess.loss_gradient(X, np.array([0.0, 1.0]), params, head=head, **kw)
    with pytest.raises(ValueError, match=r"shapes \(d, C\) = \(6, C\)"):
        blockhess.loss_gradient(X, target, params, head=(head[0][:4], head[1]), **kw)
    with pytest.raises(ValueError, match=r"shapes \(d, C\)"):
        blockhess.loss_gradient(X, target, params, head=(head[0], head[1][:2]), **kw)
    with pytest.raises(ValueError, match="W_C contains NaN"):
        blockhess.loss_gradient(X, target, params, head=(np.full_like(head[0], np.nan), head[1]), **kw)
    with pytest.raises(TypeError, match="b_C must have dtype float32 or float64"):
        blockhess.loss_gradient(X, target, params, head=(head[0], head[1].astype(np.int64)), **kw)
    with pytest.raises(ValueError, match=r"target must have shape \(\)"):
        blockhess.loss_gradient(X[0], target, params, head=head, **kw)
