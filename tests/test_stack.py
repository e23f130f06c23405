"""A stack of blocks (blockhess.ModelSpec) is composition on the engine (blocks/family.hpp,
wire_stack): each block wired on the previous one's output, its parameters prefixed by layer
("h.0.W_Q", ...). Forward, the loss's gradient and the Hessian-vector product need no new
mathematics, so the public functions on a stack must equal torch autograd of the stacked blocks,
written from their definition (the torch reference's stack: its family_block, one after another):
float64, relative error <= 1e-10. The last layer's dense Hessian and diagonal, from the per-token
factors, must match too (a whole model's, with the layers the factors do not reach:
test_model_curvature.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import reference as ref
import blockhess
from blockhess import BlockParams, BlockSpec, ModelSpec
from blockhess._torch_reference import stack

GPT2_LIKE = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                      activation="gelu_tanh", causal=True)
SPECS = {"paper": BlockSpec(), "gpt2-like": GPT2_LIKE,
         "post-rms-silu": BlockSpec(norm="rmsnorm", norm_affine=True, activation="silu", heads=2)}
L, d, dk, dff, EPS = 4, 6, 3, 7, 1e-5


def _problem(rng, spec: ModelSpec, loss: str, B: int = 2):
    params = BlockParams.random(spec, d=d, d_k=dk, d_ff=dff, seed=int(rng.integers(1 << 30)))
    X = rng.standard_normal((B, L, d))
    target = rng.standard_normal((B, L, d)) if loss == "mse" else rng.integers(0, d, size=(B, L))

    def scalar(v):
        tensors = {n: v[s].reshape(shape) for (n, s), shape in zip(params.slices().items(), params.shapes)}
        return ref.block_loss(stack(ref.t(X), spec, tensors, EPS), torch.as_tensor(target), loss)

    return params, X, target, scalar, ref.t(params.flatten())


def test_a_stack_names_its_layers_and_one_layer_is_the_block():
    spec = ModelSpec(GPT2_LIKE, n_layers=3)
    params = BlockParams.random(spec, d=d, d_k=dk, d_ff=dff)
    one = BlockParams.random(GPT2_LIKE, d=d, d_k=dk, d_ff=dff)
    assert params.names == tuple(f"h.{l}.{n}" for l in range(3) for n in one.names)
    assert params.size == 3 * one.size
    assert np.all(np.abs(params["h.2.gamma_1"] - 1) < 0.5)  # gamma starts near 1 in every layer
    normed = BlockParams.random(ModelSpec(GPT2_LIKE, n_layers=3, final_norm=True), d=d, d_k=dk, d_ff=dff)
    assert normed.names[-2:] == ("ln_f.gamma", "ln_f.beta") and normed.size == params.size + 2 * d
    rms = ModelSpec(BlockSpec(norm="rmsnorm", norm_affine=True), n_layers=2, final_norm=True)
    assert BlockParams.random(rms, d=d, d_k=dk, d_ff=dff).names[-1] == "ln_f.gamma"  # RMSNorm has no beta
    assert BlockParams.random(ModelSpec(n_layers=2, final_norm=True), d=d, d_k=dk, d_ff=dff).names[-1] == "h.1.W_2"
    single = BlockParams.random(ModelSpec(GPT2_LIKE), d=d, d_k=dk, d_ff=dff, seed=3)
    assert single.names == one.names and ModelSpec(GPT2_LIKE).layer_prefix(0) == ""
    X = np.random.default_rng(0).standard_normal((2, L, d))
    same = BlockParams.from_arrays(GPT2_LIKE, dict(zip(single.names, single.arrays)))
    assert np.array_equal(blockhess.block_forward(X, single, eps=EPS), blockhess.block_forward(X, same, eps=EPS))


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("layers,final_norm", [(2, False), (3, False), (2, True)])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_stack_loss_gradient_and_hvp_match_autograd(rng, spec_name, layers, final_norm, loss):
    spec = ModelSpec(SPECS[spec_name], n_layers=layers, final_norm=final_norm)
    params, X, target, scalar, flat = _problem(rng, spec, loss)
    V = rng.standard_normal((params.size, 2))
    # Hessian-vector products of the reference: forward over reverse, one column at a time.
    ref_HV = np.stack([torch.func.jvp(torch.func.grad(scalar), (flat,), (ref.t(c),))[1].numpy() for c in V.T], axis=1)
    assert ref.rel_err(np.asarray(blockhess.loss_value(X, target, params, loss=loss, eps=EPS)), scalar(flat).numpy()) <= 1e-13
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss, eps=EPS),
                       torch.func.grad(scalar)(flat).numpy()) <= 1e-12
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, loss=loss, eps=EPS), ref_HV) <= 1e-10
    op = blockhess.hessian_operator(X, target, params, loss=loss, eps=EPS)
    assert ref.rel_err(op @ V[:, 0], ref_HV[:, 0]) <= 1e-10


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("final_norm", [False, True])
def test_the_last_layers_dense_hessian_and_diagonal_match_autograd(rng, spec_name, final_norm):
    """The last layer's parameters and the final norm's (token-local above it)."""
    spec = ModelSpec(SPECS[spec_name], n_layers=2, final_norm=final_norm)
    params, X, target, scalar, flat = _problem(rng, spec, "cross_entropy")
    last = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")))
    chosen = np.concatenate([np.arange(params.slices()[n].start, params.slices()[n].stop) for n in last])
    ref_H = torch.func.hessian(scalar)(flat).numpy()[np.ix_(chosen, chosen)]
    H = blockhess.loss_hessian(X, target, params, loss="cross_entropy", eps=EPS, wrt=last)
    assert ref.rel_err(H, ref_H) <= 1e-10
    assert np.array_equal(H, H.T)
    op = blockhess.hessian_operator(X, target, params, loss="cross_entropy", eps=EPS, wrt=last)
    assert ref.rel_err(op.diagonal(), np.diag(ref_H)) <= 1e-10


def test_a_lower_layers_jacobian_and_the_output_hessians_refusal(rng):
    """dZ/dW for a lower layer's weight (one forward tangent per entry: the per-token factors do not
    reach it) against jacrev of the definition; the output Hessian, assembled from the factors, is
    refused there with what to use instead."""
    spec = ModelSpec(SPECS[sorted(SPECS)[0]], n_layers=2, final_norm=True)
    params = BlockParams.random(spec, d=d, d_k=dk, d_ff=dff, seed=3)
    X = rng.standard_normal((L, d))
    named = {n: ref.t(a) for n, a in zip(params.names, params.arrays)}
    for name in ("h.0.W_Q", "h.0.W_1", "h.1.W_K"):
        J = blockhess.block_jacobian(X, params, name, eps=EPS)

        def output(w, name=name):
            return stack(ref.t(X)[None], spec, {**named, name: w}, EPS).reshape(-1)

        assert ref.rel_err(J, torch.func.jacrev(output)(named[name]).reshape(J.shape).numpy()) <= 1e-12
    with pytest.raises(ValueError, match="for a lower layer use loss_hessian"):
        blockhess.block_output_hessian(X, params, "h.0.W_Q", "h.1.W_1", eps=EPS)


def test_a_stack_in_float32_is_close_to_float64(rng):
    spec = ModelSpec(GPT2_LIKE, n_layers=2)
    params, X, target, _, _ = _problem(rng, spec, "mse")
    p32 = BlockParams.from_arrays(spec, {n: a.astype(np.float32) for n, a in zip(params.names, params.arrays)})
    v = rng.standard_normal(params.size)
    hv64 = blockhess.loss_hvp(X, target, params, v, eps=EPS)
    hv32 = blockhess.loss_hvp(X.astype(np.float32), target.astype(np.float32), p32, v.astype(np.float32), eps=EPS)
    assert hv32.dtype == np.float32 and ref.rel_err(hv32, hv64) <= 1e-4


def test_bad_model_specs_are_refused():
    with pytest.raises(TypeError, match="ModelSpec.block"):
        ModelSpec("paper")
    with pytest.raises(ValueError, match="n_layers"):
        ModelSpec(BlockSpec(), n_layers=0)
    with pytest.raises(TypeError, match="final_norm must be a bool"):
        ModelSpec(BlockSpec(), final_norm=1)
    with pytest.raises(ValueError, match="attention_only"):
        ModelSpec(BlockSpec(attention_only=True), n_layers=2, final_norm=True)
    with pytest.raises(TypeError, match="BlockSpec or ModelSpec"):
        BlockParams.random("paper", d=4, d_k=2, d_ff=4)


MEASURE_STACK_PEAK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, blockhess
from peak_memory import high_water_mark, record_budget_requests

L, d, dk, dff, layers, kind = 1200, 8, 4, 8, 3, sys.argv[2]
rng = np.random.default_rng(0)
spec = blockhess.ModelSpec(blockhess.BlockSpec(), n_layers=layers)
params = blockhess.BlockParams.random(spec, d=d, d_k=dk, d_ff=dff)
X, v = rng.standard_normal((L, d)), rng.standard_normal(params.size)
last = ("h.2.W_Q",)
asked = record_budget_requests()
blockhess.loss_hvp(X[:4], X[:4], params, v)  # warm up: every lazy allocation is done
blockhess.loss_hessian(X[:4], X[:4], params, wrt=last)
before = high_water_mark()
asked.clear()
if kind == "hvp":
    blockhess.loss_hvp(X, X, params, v)
else:
    blockhess.loss_hessian(X, X, params, wrt=last)
print(high_water_mark() - before, max(asked))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", ["hvp", "hessian"])
def test_a_stacks_working_memory_estimate_covers_the_measured_peak(kind):
    """Three layers at L = 1,200 tokens, where each layer's (L, L) matrices dominate: what the call
    asks the budget for (its result and the core's estimate: every layer's values, caches and
    cotangents) covers the peak and is not a wild over-count."""
    done = subprocess.run([sys.executable, "-c", MEASURE_STACK_PEAK, str(Path(__file__).parent), kind],
                          capture_output=True, text=True, check=True)
    peak, estimate = map(int, done.stdout.split())
    assert peak <= estimate + 16 * 2**20
    assert estimate <= 4 * peak + 16 * 2**20


def test_wrt_selects_whole_layers_by_their_prefix(rng):
    """wrt=("h.1", "ln_f") is every parameter of layer 1 and of the final norm, in the canonical order."""
    spec = ModelSpec(GPT2_LIKE, n_layers=2, final_norm=True)
    params, X, target, _, _ = _problem(rng, spec, "mse")
    top = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")))
    H = blockhess.loss_hessian(X, target, params, eps=EPS, wrt=top)
    assert np.array_equal(blockhess.loss_hessian(X, target, params, eps=EPS, wrt=("ln_f", "h.1")), H)
    op = blockhess.hessian_operator(X, target, params, eps=EPS, wrt=("h.1.", "ln_f"))
    assert op.names == top and op.shape == H.shape
    with pytest.raises(ValueError, match=r"'h.7' is neither a parameter .* nor a group of them \(h.0, h.1, ln_f\)"):
        blockhess.loss_hvp(X, target, params, np.zeros(params.size), eps=EPS, wrt=("h.7",))
    with pytest.raises(ValueError, match="must name each parameter once"):
        blockhess.loss_hessian(X, target, params, eps=EPS, wrt=("h.1", "h.1.W_Q"))
