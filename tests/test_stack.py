"""A stack of blocks is composition on the engine (blocks/family.hpp, wire_stack): each block wired on
the previous one's output, its parameters prefixed by layer ("h.0.W_Q", ...). Forward, the loss's
gradient and the Hessian-vector product need no new mathematics, so the engine's own (reached
through the private test module _engine_nodes) must equal torch autograd of the stacked blocks,
written from their definition (the torch reference's family_block, one block after another):
float64, relative error <= 1e-10. The dense Hessian of a layer whose parameters reach another
block's attention through its input is not in the factored form yet; the last layer's is, and it
must match too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as ref
from blockhess import BlockParams, BlockSpec, _engine_nodes
from blockhess._torch_reference import family_block
from blockhess.spec import loss_names

GPT2_LIKE = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                      activation="gelu_tanh", causal=True)
SPECS = {"paper": BlockSpec(), "gpt2-like": GPT2_LIKE, "post-rms-silu": BlockSpec(norm="rmsnorm", norm_affine=True,
                                                                                  activation="silu", heads=2)}
L, d, dk, dff = 4, 6, 3, 7


def _layers(spec, layers, seed):
    """Each layer's BlockParams, and the stack's (name, array) list in the registry's order (each
    layer's names, prefixed)."""
    blocks = [BlockParams.random(spec, d=d, d_k=dk, d_ff=dff, seed=seed + l) for l in range(layers)]
    prefix = (lambda l: "") if layers == 1 else (lambda l: f"h.{l}.")
    named = [(prefix(l) + name, np.asarray(p[name])) for l, p in enumerate(blocks) for name in p.names]
    return blocks, named


def _torch_stack(X, spec, layers, tensors, eps):
    Z = X
    for l in range(layers):
        prefix = "" if layers == 1 else f"h.{l}."
        Z = family_block(Z, spec, {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}, eps)
    return Z


def _run(rng, spec, layers, loss, wrt_layer=None, B=2, eps=1e-5, hessian=False):
    _, named = _layers(spec, layers, seed=int(rng.integers(1 << 30)))
    names = [n for n, _ in named]
    arrays = [a for _, a in named]
    X = rng.standard_normal((B, L, d))
    values = rng.standard_normal((B, L, d)) if loss == "mse" else None
    classes = rng.integers(0, d, size=(B, L)) if loss == "cross_entropy" else None
    target = values if loss == "mse" else classes
    wrt = [wrt_layer is None or n.startswith(f"h.{wrt_layer}.") for n in names]
    sizes = [a.size for a in arrays]
    P = sum(s for s, w in zip(sizes, wrt) if w)
    V = rng.standard_normal((P, 2))
    dv = d // spec.heads  # BlockParams.random's default
    Z, value, grad, H, HV = _engine_nodes.engine_stack(spec._core(), layers, X, dk, dv, dff, arrays, eps,
                                                       loss_names().index(loss), values, classes, wrt, hessian, V)
    offsets = np.cumsum([0] + sizes)
    chosen = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in range(len(arrays)) if wrt[i]])

    def scalar(v):
        tensors = {n: v[offsets[i]:offsets[i + 1]].reshape(arrays[i].shape) for i, n in enumerate(names)}
        return ref.block_loss(_torch_stack(ref.t(X), spec, layers, tensors, eps), torch.as_tensor(target), loss)

    flat = ref.t(np.concatenate([a.ravel() for a in arrays]))
    tensors = {n: ref.t(a) for n, a in named}
    return dict(Z=Z, value=value, grad=grad, H=H, HV=HV, V=V, chosen=chosen, scalar=scalar, flat=flat,
                ref_Z=_torch_stack(ref.t(X), spec, layers, tensors, eps).numpy(), names=names)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_stack_forward_gradient_and_hvp_match_autograd(rng, spec_name, layers, loss):
    r = _run(rng, SPECS[spec_name], layers, loss)
    assert r["names"][0] == "h.0." + r["names"][0][4:] and r["names"][-1].startswith(f"h.{layers - 1}.")
    ref_grad = torch.func.grad(r["scalar"])(r["flat"]).numpy()
    # Hessian-vector products of the reference: reverse over reverse, one column at a time.
    ref_HV = np.stack([torch.func.jvp(torch.func.grad(r["scalar"]), (r["flat"],), (ref.t(c),))[1].numpy()
                       for c in r["V"].T], axis=1)
    assert ref.rel_err(r["Z"], r["ref_Z"]) <= 1e-13
    assert ref.rel_err(np.asarray(r["value"]), r["scalar"](r["flat"]).numpy()) <= 1e-13
    assert ref.rel_err(r["grad"], ref_grad) <= 1e-12
    assert ref.rel_err(r["HV"], ref_HV) <= 1e-10


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_the_last_layers_dense_hessian_matches_autograd(rng, spec_name):
    r = _run(rng, SPECS[spec_name], 2, "cross_entropy", wrt_layer=1, hessian=True)
    ref_H = torch.func.hessian(r["scalar"])(r["flat"]).numpy()[np.ix_(r["chosen"], r["chosen"])]
    assert ref.rel_err(r["H"], ref_H) <= 1e-10
    assert np.array_equal(r["H"], r["H"].T)
    assert ref.rel_err(r["HV"], ref_H @ r["V"]) <= 1e-10


def test_one_layer_is_the_block_itself(rng):
    """layers = 1: the block's own names (no prefix) and its results."""
    spec = GPT2_LIKE
    r = _run(rng, spec, 1, "mse", eps=1e-5)
    assert "h.0.W_Q" not in r["names"] and "W_Q" in r["names"]
    assert ref.rel_err(r["Z"], r["ref_Z"]) <= 1e-13
    ref_grad = torch.func.grad(r["scalar"])(r["flat"]).numpy()
    assert ref.rel_err(r["grad"], ref_grad) <= 1e-12


def test_a_lower_layers_dense_hessian_is_refused_clearly(rng):
    """Layer 0's parameters reach layer 1's attention through its input, which mixes tokens: the
    factored form does not hold there, and the engine says so instead of answering wrongly."""
    with pytest.raises(ValueError, match="mixes tokens"):
        _run(rng, BlockSpec(), 2, "mse", wrt_layer=0, hessian=True)
