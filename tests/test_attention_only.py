"""BlockSpec(attention_only=True): the self-attention sublayer alone, Z = attn(X), the lone layer of
the paper's Thm 1 (no residual, no norms, no FFN). Against the torch reference written from its
definition (blockhess._torch_reference.family_block): forward, gradient, the dense loss Hessian in
every part (float64, <= 1e-10 against torch.func.hessian and an autograd Gauss-Newton), exact
symmetry, loss_hvp and hessian_operator (its diagonal and trace) against the dense Hessian, wrt
sub-blocks, float32, the bad combinations and ``blockhess check --attention-only``."""

from __future__ import annotations

import math

import kernel_emulation
import numpy as np
import pytest
import torch

import blockhess
import reference as ref
from blockhess import BlockParams, BlockSpec
from blockhess import _torch_reference as torch_reference
from blockhess.check import main as check_main

SPECS = {
    "plain": BlockSpec(attention_only=True),
    "bias": BlockSpec(attention_only=True, bias=True),
    "causal": BlockSpec(attention_only=True, causal=True),
    "out_proj": BlockSpec(attention_only=True, out_proj=True),
    "heads2-out_proj": BlockSpec(attention_only=True, heads=2, out_proj=True),
    "heads2": BlockSpec(attention_only=True, heads=2),  # without W_O: heads * d_v == d
    "everything": BlockSpec(attention_only=True, bias=True, heads=2, out_proj=True, causal=True),
}
L, D, D_K, CLASSES = 4, 4, 3, 3


def _case(rng, spec, B, loss, dtype=np.float64):
    d_k = D_K if spec.heads == 1 else 2
    d_v = 3 if spec.out_proj else None
    params = BlockParams.random(spec, d=D, d_k=d_k, d_v=d_v, seed=int(rng.integers(1 << 30)), dtype=dtype)
    shape = (L, D) if B is None else (B, L, D)
    X = rng.standard_normal(shape).astype(dtype)
    return X, ref.random_target(rng, loss, shape, D, CLASSES, dtype), params


def _head(rng, loss, dtype=np.float64):
    """The classifier of loss="pooled_cross_entropy" (as keyword arguments); none otherwise."""
    if loss != "pooled_cross_entropy":
        return None, {}
    head = (rng.standard_normal((D, CLASSES)).astype(dtype), 0.3 * rng.standard_normal(CLASSES).astype(dtype))
    return head, {"head": head}


def _torch_loss(X, target, params, loss, head=None):
    """The loss as a function of the flat parameter vector, that vector, and Z of it."""
    output_of = torch_reference.family_of_flat(ref.t(X), params.spec, params.names, params.shapes)
    t = ref.t(target) if loss == "mse" else torch.as_tensor(target)
    torch_head = None if head is None else tuple(ref.t(a) for a in head)
    return (lambda v: torch_reference.loss(output_of(v), t, loss, torch_head)), ref.t(params.flatten()), output_of


def _gauss_newton(X, target, params, loss, head=None):
    """J^T H_loss J from autograd: the outer part's reference."""
    f, v, output_of = _torch_loss(X, target, params, loss, head)
    Z = output_of(v)
    J = torch.func.jacrev(output_of)(v).reshape(Z.numel(), -1)
    t = ref.t(target) if loss == "mse" else torch.as_tensor(target)
    torch_head = None if head is None else tuple(ref.t(a) for a in head)
    H_loss = torch.func.hessian(lambda z: torch_reference.loss(z.reshape(Z.shape), t, loss, torch_head))(Z.reshape(-1))
    return (J.T @ H_loss @ J).numpy()


def test_the_reference_is_the_definition(rng):
    """The torch reference's attention-only block is softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V."""
    X, _, params = _case(rng, SPECS["plain"], None, "mse")
    WQ, WK, WV = (ref.t(params[n]) for n in ("W_Q", "W_K", "W_V"))
    Xt = ref.t(X)
    Z = torch.softmax(Xt @ WQ @ WK.T @ Xt.T / math.sqrt(D_K), dim=-1) @ Xt @ WV
    named = dict(zip(params.names, (ref.t(a) for a in params.arrays)))
    assert ref.rel_err(torch_reference.family_block(Xt, params.spec, named).numpy(), Z.numpy()) <= 1e-15


def test_parameters_and_spec():
    spec = SPECS["everything"]
    params = BlockParams.random(spec, d=D, d_k=2, d_v=3)
    assert params.names == ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O")
    assert BlockParams.random(SPECS["plain"], d=D, d_k=2, d_ff=99).names == ("W_Q", "W_K", "W_V")  # d_ff ignored
    assert params.d_ff == 0 and "d_ff" not in repr(params)
    assert not spec.is_paper_block and not SPECS["plain"].is_paper_block
    assert spec._core()[8] is True and BlockSpec()._core()[8] is False
    with pytest.raises(TypeError, match="d_ff"):
        BlockParams.random(BlockSpec(), d=D, d_k=2)  # a whole block still needs it
    with pytest.raises(ValueError, match="unexpected W_1"):
        BlockParams.from_arrays(SPECS["plain"], {**{n: a for n, a in zip(params.names[:5:2], params.arrays[:5:2])},
                                                 "W_1": np.ones((D, 2))})


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy"])
def test_attention_only_matches_autograd(rng, name, B, loss):
    spec = SPECS[name]
    X, target, params = _case(rng, spec, B, loss)
    head, kw = _head(rng, loss)
    f, v, output_of = _torch_loss(X, target, params, loss, head)
    assert ref.rel_err(blockhess.block_forward(X, params), output_of(v).numpy()) <= 1e-12
    assert blockhess.loss_value(X, target, params, loss=loss, **kw) == pytest.approx(float(f(v)), rel=1e-12)
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss, **kw), torch.func.grad(f)(v).numpy()) <= 1e-11
    H = blockhess.loss_hessian(X, target, params, loss=loss, **kw)
    assert ref.rel_err(H, torch.func.hessian(f)(v).numpy()) <= 1e-10
    assert np.array_equal(H, H.T)
    outer = blockhess.loss_hessian(X, target, params, loss=loss, part="outer", **kw)
    functional = blockhess.loss_hessian(X, target, params, loss=loss, part="functional", **kw)
    assert np.array_equal(outer, outer.T) and np.array_equal(functional, functional.T)
    assert ref.rel_err(outer, _gauss_newton(X, target, params, loss, head)) <= 1e-10
    assert ref.rel_err(outer + functional, H) <= 1e-12
    V = rng.standard_normal((params.size, 2))
    for part, dense in (("full", H), ("outer", outer), ("functional", functional)):
        assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, loss=loss, part=part, **kw), dense @ V) <= 1e-12
        op = blockhess.hessian_operator(X, target, params, loss=loss, part=part, **kw)
        assert ref.rel_err(op @ V, dense @ V) <= 1e-12
        np.testing.assert_allclose(op.diagonal(), np.diag(dense), rtol=0, atol=1e-13 * np.abs(dense).max())
        assert op.trace() == pytest.approx(np.trace(dense), rel=1e-12, abs=1e-14 * np.abs(dense).max())


def test_thm1_setting_mse_on_a_lone_layer(rng):
    """The paper's Thm 1 setting: one head, no bias, loss = 1/(L d_V) ||Z - Target||_F^2."""
    X, target, params = _case(rng, SPECS["plain"], None, "mse")
    Z = blockhess.block_forward(X, params)
    assert blockhess.loss_value(X, target, params) == pytest.approx(np.sum((Z - target) ** 2) / (L * D), rel=1e-14)


def test_jacobian_and_output_hessian_match_autograd(rng):
    X, _, params = _case(rng, SPECS["everything"], None, "mse")
    _, v, output_of = _torch_loss(X, rng.standard_normal((L, D)), params, "mse")
    J = torch.func.jacrev(output_of)(v).reshape(L * D, -1).numpy()
    H = torch.func.hessian(output_of)(v).reshape(L * D, params.size, params.size).numpy()
    where = params.slices()
    # Relative to the whole derivative: b_K's blocks are exactly 0 here and rounding noise in torch.
    for name in params.names:
        got = blockhess.block_jacobian(X, params, name)
        np.testing.assert_allclose(got, J[:, where[name]], rtol=0, atol=1e-12 * np.abs(J).max())
    for a, b in (("W_Q", "W_K"), ("W_V", "W_O"), ("b_Q", "W_V"), ("W_Q", "W_Q"), ("b_K", "W_Q")):
        got = blockhess.block_output_hessian(X, params, a, b)
        want = H[:, where[a], where[b]].reshape(got.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-11 * np.abs(H).max())


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_wrt_subsets_and_the_blocks_layout_are_sub_blocks(rng, loss):
    X, target, params = _case(rng, SPECS["everything"], 2, loss)
    where = params.slices()
    for part in ("full", "outer", "functional"):
        H = blockhess.loss_hessian(X, target, params, loss=loss, part=part)
        for wrt in (("W_Q",), ("b_Q", "W_O"), ("W_K", "b_K"), ("W_V", "b_V", "b_O")):
            rows = np.concatenate([np.arange(where[n].start, where[n].stop) for n in wrt])
            sub = blockhess.loss_hessian(X, target, params, loss=loss, part=part, wrt=wrt)
            np.testing.assert_allclose(sub, H[np.ix_(rows, rows)], rtol=0, atol=1e-13 * np.abs(H).max())
            diag = blockhess.hessian_operator(X, target, params, loss=loss, part=part, wrt=wrt).diagonal()
            np.testing.assert_allclose(diag, np.diag(H)[rows], rtol=0, atol=1e-13 * np.abs(H).max())
        blocks = blockhess.loss_hessian(X, target, params, loss=loss, part=part, layout="blocks")
        for a in params.names:
            for b in params.names:
                np.testing.assert_array_equal(blocks[a, b], H[where[a], where[b]])
    out = np.empty((params.size, params.size))
    assert blockhess.loss_hessian(X, target, params, loss=loss, out=out) is out
    np.testing.assert_array_equal(out, blockhess.loss_hessian(X, target, params, loss=loss))


def test_the_key_bias_has_no_effect(rng):
    """softmax ignores a shift shared by a whole row of logits: b_K's derivatives are exactly 0."""
    X, target, params = _case(rng, SPECS["bias"], 3, "mse")
    H = blockhess.loss_hessian(X, target, params, layout="blocks")
    assert not np.any(H["b_K", "b_K"]) and not np.any(H["W_Q", "b_K"])


@pytest.mark.parametrize("name", ["plain", "everything"])
def test_float32_is_close_to_float64(rng, name):
    X, target, params = _case(rng, SPECS[name], 2, "mse")
    p32 = BlockParams.from_arrays(params.spec, {n: a.astype(np.float32) for n, a in zip(params.names, params.arrays)})
    X32, t32 = X.astype(np.float32), target.astype(np.float32)
    H64 = blockhess.loss_hessian(X, target, params)
    H32 = blockhess.loss_hessian(X32, t32, p32)
    assert H32.dtype == np.float32 and np.array_equal(H32, H32.T)
    assert ref.rel_err(H32, H64) <= 1e-4
    V = rng.standard_normal(params.size).astype(np.float32)
    assert ref.rel_err(blockhess.loss_hvp(X32, t32, p32, V), H64 @ V) <= 1e-4
    assert ref.rel_err(blockhess.hessian_operator(X32, t32, p32).diagonal(), np.diag(H64)) <= 1e-4


@pytest.mark.parametrize("field, value", [("norm_affine", True), ("norm_position", "pre"), ("norm", "rmsnorm"),
                                          ("activation", "gelu"), ("activation", "silu")])
def test_meaningless_combinations_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"BlockSpec\.{field}.*attention_only"):
        BlockSpec(attention_only=True, **{field: value})


def test_the_core_refuses_them_too():
    """A C++ caller (or a hand-made spec tuple) cannot slip a norm option past the Python check."""
    from blockhess import _core

    core = BlockSpec(attention_only=True)._core()
    assert [name for name, _ in _core.block_parameters(core, 4, 2, 4, 0)] == ["W_Q", "W_K", "W_V"]
    for at in (0, 1, 2):  # norm_position "pre", norm "rmsnorm", norm_affine
        with pytest.raises(ValueError, match="attention_only has no norms"):
            _core.block_parameters(core[:at] + (True,) + core[at + 1:], 4, 2, 4, 0)
    with pytest.raises(ValueError, match="attention_only has no norms"):
        _core.block_parameters(core[:6] + (1,) + core[7:], 4, 2, 4, 0)  # gelu


def test_bad_flag_and_sizes_are_refused():
    with pytest.raises(TypeError, match="BlockSpec.attention_only"):
        BlockSpec(attention_only=1)
    with pytest.raises(ValueError, match="heads \\* d_v must equal d"):
        BlockParams.random(BlockSpec(attention_only=True), d=4, d_k=2, d_v=3)


@kernel_emulation.needs_emulator
def test_the_gpu_path_runs_it_through_the_engine(monkeypatch, rng, cpu_kernels):
    """Device arrays (the CuPy stand-in of tests/cupy_emulation.py, the kernels and bindings on the
    CPU emulator): the Jacobian, the gradient and Hessian-vector products run the engine on the GPU
    backend, equal to the CPU's to rounding (cuBLAS's sums in another order); the operator's
    diagonal on host copies, equal bit for bit; all returned on the device."""
    import cupy_emulation

    from blockhess import _backend

    monkeypatch.setattr(_backend, "_cuda", cpu_kernels)
    hooks = kernel_emulation.install(monkeypatch, cpu_kernels)
    cupy_emulation.install(monkeypatch)
    X, target, params = _case(rng, SPECS["plain"], None, "mse")
    on_device = BlockParams.from_arrays(params.spec, {n: cupy_emulation.to_device(a)
                                                      for n, a in zip(params.names, params.arrays)})
    Xd, Td = cupy_emulation.to_device(X), cupy_emulation.to_device(target)
    op, op_host = blockhess.hessian_operator(Xd, Td, on_device), blockhess.hessian_operator(X, target, params)
    v = rng.standard_normal(op.shape[0])
    on_host_copies = ((op.diagonal(), op_host.diagonal()),)
    hooks.calls.clear()
    on_gpu = ((blockhess.block_jacobian(Xd, on_device, "W_Q"), blockhess.block_jacobian(X, params, "W_Q")),
              (blockhess.block_forward(Xd, on_device), blockhess.block_forward(X, params)),
              (blockhess.loss_gradient(Xd, Td, on_device), blockhess.loss_gradient(X, target, params)),
              (op @ cupy_emulation.to_device(v), op_host @ v),
              (blockhess.loss_hvp(Xd, Td, on_device, cupy_emulation.to_device(v)), blockhess.loss_hvp(X, target, params, v)))
    # (the operator's products: its own apply)
    assert hooks.calls == ["block_jacobian", "block_forward", "loss_gradient", "loss_hvp"], hooks.calls
    for got, want in on_host_copies:
        assert isinstance(got, cupy_emulation.DevArray)
        np.testing.assert_array_equal(np.asarray(got), want)
    for got, want in on_gpu:
        assert isinstance(got, cupy_emulation.DevArray)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    with pytest.raises(TypeError, match="same side as X"):
        blockhess.loss_hvp(Xd, Td, on_device, v)


def test_blockhess_check_attention_only(capsys):
    assert check_main(["--attention-only", "--L", "5", "--d", "4", "--d-k", "2", "--quiet"]) == 0
    assert "self-attention layer" in capsys.readouterr().out
    assert check_main(["--attention-only", "--L", "5", "--d", "4", "--d-k", "2", "--heads", "2", "--out-proj",
                       "--bias", "--causal", "--loss", "cross_entropy", "--quiet"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        check_main(["--attention-only", "--norm", "rmsnorm", "--L", "5", "--d", "4", "--d-k", "2"])
    assert refused.value.code == 2 and "BlockSpec.norm" in capsys.readouterr().err


@kernel_emulation.needs_emulator
@pytest.mark.parametrize("name", sorted(SPECS))
def test_loss_hessian_on_the_gpu_path(emulated_gpu, rng, name):
    """The engine's GPU assembly (the real kernels and bindings compiled for the CPU,
    tests/kernel_emulation.py) gives the CPU core's Hessian of an attention-only block."""
    cupy, _ = emulated_gpu
    X, target, params = _case(rng, SPECS[name], 2, "mse")
    on_device = BlockParams.from_arrays(params.spec, {n: cupy.asarray(a) for n, a in zip(params.names, params.arrays)})
    for part in ("full", "outer", "functional"):
        H = blockhess.loss_hessian(cupy.asarray(X), cupy.asarray(target), on_device, part=part)
        want = blockhess.loss_hessian(X, target, params, part=part)
        assert np.linalg.norm(H - want) <= 1e-12 * np.linalg.norm(want)
        np.testing.assert_array_equal(H, H.T)
