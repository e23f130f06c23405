"""The block family (BlockSpec) against the torch reference written from its definition
(blockhess._torch_reference.family_block): forward, gradient, the dense loss Hessian in every part
(float64, <= 1e-10 against torch.func.hessian), exact symmetry, loss_hvp, wrt subsets, float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import blockhess
import reference as ref
from blockhess import BlockParams, BlockSpec
from blockhess import _torch_reference as torch_reference

# Every option both ways; the last ones switch on everything the engine wires so far.
SPECS = {
    "paper": BlockSpec(),
    "affine": BlockSpec(norm_affine=True),
    "bias": BlockSpec(bias=True),
    "out_proj": BlockSpec(out_proj=True),
    "gelu": BlockSpec(activation="gelu", eps=1e-3),
    "gelu_tanh-causal": BlockSpec(activation="gelu_tanh", causal=True),
    "silu-bias-out_proj": BlockSpec(activation="silu", bias=True, out_proj=True),
    "pre": BlockSpec(norm_position="pre"),
    "pre-bias-out_proj-gelu_tanh-causal": BlockSpec(norm_position="pre", bias=True, out_proj=True,
                                                    activation="gelu_tanh", causal=True, eps=1e-5),
    "pre-silu-causal": BlockSpec(norm_position="pre", activation="silu", causal=True),
    "affine-causal-out_proj": BlockSpec(norm_affine=True, causal=True, out_proj=True),
    "post-everything": BlockSpec(norm_affine=True, bias=True, out_proj=True, activation="gelu", causal=True,
                                 eps=1e-3),
    "heads2-out_proj": BlockSpec(heads=2, out_proj=True),
    "post-everything-heads2": BlockSpec(norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                                        causal=True, eps=1e-3),
    "pre-affine": BlockSpec(norm_position="pre", norm_affine=True),
    "rmsnorm": BlockSpec(norm="rmsnorm", eps=1e-6),
    "pre-rmsnorm-affine-heads2-silu-causal": BlockSpec(norm_position="pre", norm="rmsnorm", norm_affine=True, heads=2,
                                                       bias=True, out_proj=True, activation="silu", causal=True, eps=1e-6),
    "pre-everything-heads2": BlockSpec(norm_position="pre", norm_affine=True, heads=2, bias=True, out_proj=True,
                                       activation="gelu_tanh", causal=True, eps=1e-5),
    "pre-heads2-bias-out_proj-gelu_tanh-causal": BlockSpec(norm_position="pre", heads=2, bias=True, out_proj=True,
                                                           activation="gelu_tanh", causal=True),
}
L, D, D_K, D_FF = 4, 5, 3, 6


def _case(rng, spec, B, loss, dtype=np.float64):
    d_v = (4 if spec.heads == 1 else 2) if spec.out_proj else None
    d_k = D_K if spec.heads == 1 else 2
    params = BlockParams.random(spec, d=D, d_k=d_k, d_ff=D_FF, d_v=d_v, seed=int(rng.integers(1 << 30)), dtype=dtype)
    shape = (L, D) if B is None else (B, L, D)
    X = rng.standard_normal(shape).astype(dtype)
    if loss == "mse":
        target = rng.standard_normal(shape).astype(dtype)
    else:
        target = rng.integers(0, D, shape[:-1])
    return X, target, params


def _torch_loss(X, target, params, loss):
    """The loss as a function of the flat parameter vector, and that vector."""
    output_of = torch_reference.family_of_flat(ref.t(X), params.spec, params.names, params.shapes)
    t = torch.as_tensor(target) if loss == "cross_entropy" else ref.t(target)
    return (lambda v: torch_reference.loss(output_of(v), t, loss)), ref.t(params.flatten()), output_of


def _gauss_newton(X, target, params, loss):
    """J^T H_loss J from autograd: the outer part's reference."""
    f, v, output_of = _torch_loss(X, target, params, loss)
    Z = output_of(v)
    J = torch.func.jacrev(output_of)(v).reshape(Z.numel(), -1)
    t = torch.as_tensor(target) if loss == "cross_entropy" else ref.t(target)
    H_loss = torch.func.hessian(lambda z: torch_reference.loss(z.reshape(Z.shape), t, loss))(Z.reshape(-1))
    return (J.T @ H_loss @ J).numpy()


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_family_matches_autograd(rng, name, B, loss):
    spec = SPECS[name]
    X, target, params = _case(rng, spec, B, loss)
    f, v, output_of = _torch_loss(X, target, params, loss)
    assert ref.rel_err(blockhess.block_forward(X, params), output_of(v).numpy()) <= 1e-12
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss), torch.func.grad(f)(v).numpy()) <= 1e-11
    H = blockhess.loss_hessian(X, target, params, loss=loss)
    H_ref = torch.func.hessian(f)(v).numpy()
    assert ref.rel_err(H, H_ref) <= 1e-10
    assert np.array_equal(H, H.T)
    outer = blockhess.loss_hessian(X, target, params, loss=loss, part="outer")
    functional = blockhess.loss_hessian(X, target, params, loss=loss, part="functional")
    assert ref.rel_err(outer, _gauss_newton(X, target, params, loss)) <= 1e-10
    assert ref.rel_err(outer + functional, H) <= 1e-12
    V = rng.standard_normal((params.size, 2))
    for part, dense in (("full", H), ("outer", outer), ("functional", functional)):
        assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, loss=loss, part=part), dense @ V) <= 1e-12


@pytest.mark.parametrize("name", ["post-everything", "pre-bias-out_proj-gelu_tanh-causal"])
def test_family_wrt_subsets_are_sub_blocks(rng, name):
    X, target, params = _case(rng, SPECS[name], 2, "mse")
    H = blockhess.loss_hessian(X, target, params)
    where = params.slices()
    for wrt in (("b_Q", "W_O"), ("W_K", "b_K"), tuple(n for n in params.names if not n.startswith("W"))):
        wrt = tuple(n for n in wrt if n in params.names)
        sub = blockhess.loss_hessian(X, target, params, wrt=wrt)
        rows = np.concatenate([np.arange(where[n].start, where[n].stop) for n in wrt])
        np.testing.assert_allclose(sub, H[np.ix_(rows, rows)], rtol=0, atol=1e-13 * np.abs(H).max())
    blocks = blockhess.loss_hessian(X, target, params, layout="blocks")
    last = params.names[-1]
    assert blocks["W_1", last].shape == (params["W_1"].size, params[last].size)


def test_the_key_bias_has_no_effect(rng):
    """softmax ignores a shift shared by a whole row of logits: b_K's derivatives are exactly 0."""
    X, target, params = _case(rng, SPECS["bias"], 3, "mse")
    H = blockhess.loss_hessian(X, target, params, layout="blocks")
    assert not np.any(H["b_K", "b_K"]) and not np.any(H["W_Q", "b_K"])
    assert not np.any(blockhess.loss_gradient(X, target, params)[params.slices()["b_K"]])


def test_family_float32_is_close_to_float64(rng):
    spec = SPECS["post-everything"]
    X, target, params = _case(rng, spec, 2, "mse")
    p32 = BlockParams.from_arrays(spec, {n: params[n].astype(np.float32) for n in params.names})
    H64 = blockhess.loss_hessian(X, target, params)
    H32 = blockhess.loss_hessian(X.astype(np.float32), target.astype(np.float32), p32)
    assert H32.dtype == np.float32
    assert ref.rel_err(H32, H64) <= 1e-4


def test_spec_is_a_frozen_readable_value():
    spec = BlockSpec(norm_position="pre", bias=True)
    assert spec == BlockSpec(norm_position="pre", bias=True) and hash(spec) == hash(BlockSpec(norm_position="pre", bias=True))
    assert "norm_position='pre'" in repr(spec) and "bias=True" in repr(spec)
    with pytest.raises(AttributeError):
        spec.bias = False
    assert BlockSpec().is_paper_block and not spec.is_paper_block


def test_bad_specs_and_arrays_are_named(rng):
    with pytest.raises(ValueError, match="norm_position"):
        BlockSpec(norm_position="middle")
    with pytest.raises(ValueError, match="activation"):
        BlockSpec(activation="tanh")
    with pytest.raises(ValueError, match="heads"):
        BlockSpec(heads=0)
    with pytest.raises(TypeError, match="bias"):
        BlockSpec(bias=1)
    with pytest.raises(ValueError, match="eps"):
        BlockSpec(eps=-1.0)
    for spec, what in ((BlockSpec(heads=3), "heads \\* d_v must equal d"),):
        with pytest.raises(ValueError, match=what):
            BlockParams.random(spec, d=4, d_k=2, d_ff=3)
    spec = BlockSpec(bias=True)
    arrays = {n: params for n, params in zip(BlockParams.random(spec, d=4, d_k=2, d_ff=3).names,
                                              BlockParams.random(spec, d=4, d_k=2, d_ff=3).arrays)}
    with pytest.raises(ValueError, match="missing b_1"):
        BlockParams.from_arrays(spec, {n: a for n, a in arrays.items() if n != "b_1"})
    with pytest.raises(ValueError, match="unexpected W_O"):
        BlockParams.from_arrays(spec, {**arrays, "W_O": np.eye(4)})
    with pytest.raises(ValueError, match=r"b_2 must have shape \(4,\)"):
        BlockParams.from_arrays(spec, {**arrays, "b_2": np.ones(5)})
    with pytest.raises(TypeError, match="BlockSpec"):
        BlockParams.from_arrays("post", arrays)


def test_eps_comes_from_the_spec_unless_given(rng):
    spec = BlockSpec(eps=0.5)
    params = BlockParams.random(spec, d=4, d_k=2, d_ff=3)
    X = rng.standard_normal((3, 4))
    np.testing.assert_array_equal(blockhess.block_forward(X, params), blockhess.block_forward(X, params, eps=0.5))
    assert not np.allclose(blockhess.block_forward(X, params), blockhess.block_forward(X, params, eps=0.0))


def test_unflatten_keeps_the_spec(rng):
    params = BlockParams.random(SPECS["post-everything"], d=5, d_k=3, d_ff=6, d_v=4)
    again = BlockParams.unflatten(params.flatten(), params)
    assert again.spec == params.spec and again.names == params.names
    np.testing.assert_array_equal(again.flatten(), params.flatten())
