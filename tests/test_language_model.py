"""A language model (blockhess.ModelSpec with vocab_size, n_positions and lm_head: GPT-2's shape) is
composition on the engine too: an embedding node (engine/nodes/embedding.hpp: token ids looked up in
wte, plus wpe), the stack of blocks, the final norm and the LM head tied to wte
(engine/nodes/unembedding.hpp: one parameter used twice, its gradient and H v summed over both
uses). Its loss next_token is Hugging Face's causal-LM loss (engine/heads/next_token.hpp).

Every function must equal torch autograd of the same model written from its definition (the torch
reference's stack: wte[X] + wpe[:L], family_block after family_block, ln_f, Z wte^T; one tensor wte
used twice, so that autograd sums its uses), and its loss from the definition (cross-entropy of
position i's logits against label i + 1, -100 ignored, the mean over the rest): float64, relative
error <= 1e-10. LayerNorm in the reference is written from its definition: torch's native
layer_norm is wrong under forward-over-reverse AD in torch 2.13 (docs/errata.md, guide).
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
from blockhess._torch_reference import loss as reference_loss
from blockhess._torch_reference import stack

GPT2_LIKE = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                      activation="gelu_tanh", causal=True)
EPS = 1e-5
SIZES = {"small": dict(vocab=11, d=6, dk=3, dff=7, L=5), "wider": dict(vocab=17, d=8, dk=2, dff=10, L=7)}


def _model(rng, size: str, *, layers: int = 2, positions: bool = True, final_norm: bool = True, block=GPT2_LIKE):
    s = SIZES[size]
    spec = ModelSpec(block, n_layers=layers, final_norm=final_norm, vocab_size=s["vocab"],
                     n_positions=s["L"] + 2 if positions else 0, lm_head=True)
    params = BlockParams.random(spec, d=s["d"], d_k=s["dk"], d_ff=s["dff"], seed=int(rng.integers(1 << 30)))
    return spec, params, s


def _scalar(spec, params, X, target, loss):
    """The reference loss as a function of the flat parameter vector."""
    def scalar(v):
        named = {n: v[sl].reshape(shape) for (n, sl), shape in zip(params.slices().items(), params.shapes)}
        return reference_loss(stack(torch.as_tensor(X), spec, named, EPS), torch.as_tensor(target), loss)
    return scalar


def _labels(rng, X, vocab):
    """Labels as a causal LM's (the ids themselves), some ignored (-100)."""
    labels = X.copy()
    labels[rng.random(X.shape) < 0.25] = -100
    labels[..., 1] = X[..., 1]  # at least one counted label per sample
    return labels


def test_a_language_models_parameters_start_with_its_embeddings_and_the_tied_head_adds_none(rng):
    spec, params, s = _model(rng, "small")
    block = BlockParams.random(ModelSpec(GPT2_LIKE, n_layers=2, final_norm=True), d=s["d"], d_k=s["dk"], d_ff=s["dff"])
    assert params.names[:2] == ("wte", "wpe") and params.names[2:] == block.names
    assert params["wte"].shape == (s["vocab"], s["d"]) and params["wpe"].shape == (s["L"] + 2, s["d"])
    assert params.size == block.size + (s["vocab"] + s["L"] + 2) * s["d"]  # wte counted once
    X = rng.integers(0, s["vocab"], size=(3, s["L"]))
    assert blockhess.block_forward(X, params, eps=EPS).shape == (3, s["L"], s["vocab"])
    assert blockhess.block_forward(X[0], params, eps=EPS).shape == (s["L"], s["vocab"])
    no_head = BlockParams.random(ModelSpec(GPT2_LIKE, vocab_size=s["vocab"]), d=s["d"], d_k=s["dk"], d_ff=s["dff"])
    assert no_head.names[0] == "wte" and blockhess.block_forward(X, no_head, eps=EPS).shape == (3, s["L"], s["d"])


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("loss", ["next_token", "cross_entropy", "mse"])
def test_loss_gradient_and_hvp_match_autograd(rng, size, B, loss):
    spec, params, s = _model(rng, size)
    X = rng.integers(0, s["vocab"], size=(B, s["L"]))
    target = {"next_token": _labels(rng, X, s["vocab"]), "cross_entropy": rng.integers(0, s["vocab"], X.shape),
              "mse": rng.standard_normal((B, s["L"], s["vocab"]))}[loss]
    scalar, flat = _scalar(spec, params, X, target, loss), ref.t(params.flatten())
    named = {n: ref.t(a) for n, a in zip(params.names, params.arrays)}
    Z = stack(torch.as_tensor(X), spec, named, EPS).numpy()
    assert ref.rel_err(blockhess.block_forward(X, params, eps=EPS), Z) <= 1e-12
    assert ref.rel_err(np.asarray(blockhess.loss_value(X, target, params, loss=loss, eps=EPS)),
                       scalar(flat).numpy()) <= 1e-13
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss, eps=EPS),
                       torch.func.grad(scalar)(flat).numpy()) <= 1e-11
    V = rng.standard_normal((params.size, 2))
    ref_HV = np.stack([torch.func.jvp(torch.func.grad(scalar), (flat,), (ref.t(c),))[1].numpy() for c in V.T], axis=1)
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, loss=loss, eps=EPS), ref_HV) <= 1e-10
    op = blockhess.hessian_operator(X, target, params, loss=loss, eps=EPS)
    assert ref.rel_err(op @ V[:, 1], ref_HV[:, 1]) <= 1e-10
    # the parts: outer + functional = full, product by product
    outer = blockhess.loss_hvp(X, target, params, V, loss=loss, eps=EPS, part="outer")
    functional = blockhess.loss_hvp(X, target, params, V, loss=loss, eps=EPS, part="functional")
    assert ref.rel_err(outer + functional, ref_HV) <= 1e-10


def test_the_tied_weights_gradient_sums_both_uses(rng):
    """wte's rows of the gradient: the embedding's share plus the LM head's, against autograd of the
    model where the two uses are two tensors (then summed). Its H v rows are checked against the
    tied reference in test_loss_gradient_and_hvp_match_autograd."""
    spec, params, s = _model(rng, "small")
    X = rng.integers(0, s["vocab"], size=(2, s["L"]))
    labels = _labels(rng, X, s["vocab"])
    named = {n: ref.t(a) for n, a in zip(params.names, params.arrays)}
    wte_in, wte_out = named["wte"].clone(), named["wte"].clone()

    def loss_of(w_in, w_out):
        untied = ModelSpec(spec.block, n_layers=spec.n_layers, final_norm=True, vocab_size=s["vocab"],
                           n_positions=spec.n_positions)
        Z = stack(torch.as_tensor(X), untied, {**named, "wte": w_in}, EPS) @ w_out.T
        return reference_loss(Z, torch.as_tensor(labels), "next_token")

    g_in, g_out = torch.func.grad(loss_of, argnums=(0, 1))(wte_in, wte_out)
    grad = blockhess.loss_gradient(X, labels, params, loss="next_token", eps=EPS)
    assert ref.rel_err(grad[params.slices()["wte"]], (g_in + g_out).reshape(-1).numpy()) <= 1e-12
    assert g_in.abs().sum() > 0 and g_out.abs().sum() > 0  # both uses count


@pytest.mark.parametrize("loss", ["next_token", "mse"])
def test_the_last_layers_dense_hessian_matches_autograd_and_splits_into_its_parts(rng, loss):
    spec, params, s = _model(rng, "small")
    X = rng.integers(0, s["vocab"], size=(2, s["L"]))
    target = _labels(rng, X, s["vocab"]) if loss == "next_token" else rng.standard_normal((2, s["L"], s["vocab"]))
    scalar, flat = _scalar(spec, params, X, target, loss), ref.t(params.flatten())
    last = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")))
    chosen = np.concatenate([np.arange(params.slices()[n].start, params.slices()[n].stop) for n in last])
    ref_H = torch.func.hessian(scalar)(flat).numpy()[np.ix_(chosen, chosen)]
    H = blockhess.loss_hessian(X, target, params, loss=loss, eps=EPS, wrt=last)
    assert ref.rel_err(H, ref_H) <= 1e-10 and np.array_equal(H, H.T)
    parts = [blockhess.loss_hessian(X, target, params, loss=loss, eps=EPS, wrt=last, part=p) for p in ("outer", "functional")]
    assert ref.rel_err(parts[0] + parts[1], H) <= 1e-12
    op = blockhess.hessian_operator(X, target, params, loss=loss, eps=EPS, wrt=last)
    assert ref.rel_err(op.diagonal(), np.diag(ref_H)) <= 1e-10


def test_without_positions_or_final_norm_and_with_the_papers_block(rng):
    spec, params, s = _model(rng, "small", layers=1, positions=False, final_norm=False, block=BlockSpec())
    assert params.names[:2] == ("wte", "W_Q")  # one layer: the block's own names
    X = rng.integers(0, s["vocab"], size=(2, s["L"]))
    labels = _labels(rng, X, s["vocab"])
    scalar, flat = _scalar(spec, params, X, labels, "next_token"), ref.t(params.flatten())
    v = rng.standard_normal(params.size)
    ref_hv = torch.func.jvp(torch.func.grad(scalar), (flat,), (ref.t(v),))[1].numpy()
    assert ref.rel_err(blockhess.loss_hvp(X, labels, params, v, loss="next_token", eps=EPS), ref_hv) <= 1e-10


def test_a_language_model_in_float32_is_close_to_float64(rng):
    spec, params, s = _model(rng, "wider")
    p32 = BlockParams.from_arrays(spec, {n: a.astype(np.float32) for n, a in zip(params.names, params.arrays)})
    X = rng.integers(0, s["vocab"], size=(2, s["L"]))
    labels, v = _labels(rng, X, s["vocab"]), rng.standard_normal(params.size)
    hv64 = blockhess.loss_hvp(X, labels, params, v, loss="next_token", eps=EPS)
    hv32 = blockhess.loss_hvp(X, labels, p32, v.astype(np.float32), loss="next_token", eps=EPS)
    assert hv32.dtype == np.float32 and ref.rel_err(hv32, hv64) <= 1e-4


def test_bad_language_model_input_is_refused_clearly(rng):
    spec, params, s = _model(rng, "small")
    X = rng.integers(0, s["vocab"], size=(2, s["L"]))
    labels = _labels(rng, X, s["vocab"])
    with pytest.raises(ValueError, match=r"token id 11 is out of range: ids must lie in \[0, 11\)"):
        blockhess.loss_value(np.full((2, s["L"]), 11), labels, params, loss="next_token")
    with pytest.raises(TypeError, match="integer token ids"):
        blockhess.block_forward(X.astype(np.float64), params)
    with pytest.raises(ValueError, match="n_positions = 7"):
        blockhess.block_forward(rng.integers(0, 11, size=(1, 8)), params)
    with pytest.raises(ValueError, match="-100"):
        blockhess.loss_value(X, np.full_like(X, 12), params, loss="next_token")
    with pytest.raises(ValueError, match="not -100 at some position after the first"):
        blockhess.loss_value(X, np.full_like(X, -100), params, loss="next_token")
    with pytest.raises(ValueError, match="lm_head=True"):
        blockhess.loss_value(rng.standard_normal((2, 4, 6)), np.zeros((2, 4), dtype=int),
                             BlockParams.random(BlockSpec(), d=6, d_k=3, d_ff=5), loss="next_token")
    with pytest.raises(ValueError, match="an lm_head needs a token embedding"):
        ModelSpec(GPT2_LIKE, lm_head=True)
    with pytest.raises(ValueError, match="vocab_size must be >= 0"):
        ModelSpec(GPT2_LIKE, vocab_size=-1)
    before = X.copy()
    blockhess.loss_gradient(X, labels, params, loss="next_token")
    assert np.array_equal(X, before)  # the caller's ids are not modified


MEASURE_LM_PEAK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, blockhess
from peak_memory import high_water_mark, record_budget_requests

L, d, dk, dff, V, kind = 400, 8, 4, 8, 20000, sys.argv[2]
rng = np.random.default_rng(0)
spec = blockhess.ModelSpec(blockhess.BlockSpec(), n_layers=2, vocab_size=V, n_positions=L, lm_head=True)
params = blockhess.BlockParams.random(spec, d=d, d_k=dk, d_ff=dff)
ids, v = rng.integers(0, V, size=(1, L)), rng.standard_normal(params.size)
asked = record_budget_requests()
blockhess.loss_hvp(ids[:, :4], ids[:, :4], params, v, loss="next_token")  # warm up: every lazy allocation is done
blockhess.loss_value(ids[:, :4], ids[:, :4], params, loss="next_token")
before = high_water_mark()
asked.clear()
if kind == "hvp":
    blockhess.loss_hvp(ids, ids, params, v, loss="next_token")
else:
    blockhess.loss_gradient(ids, ids, params, loss="next_token")
print(high_water_mark() - before, max(asked))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", ["hvp", "gradient"])
def test_a_language_models_working_memory_estimate_covers_the_measured_peak(kind):
    """A vocabulary of 20,000 at L = 400, where the logits (tokens x vocab: their value, cotangent,
    the head's softmax and gradient, a product's tangents) dominate: what the call asks the budget
    for (its result and the core's estimate) covers the peak and is not a wild over-count."""
    done = subprocess.run([sys.executable, "-c", MEASURE_LM_PEAK, str(Path(__file__).parent), kind],
                          capture_output=True, text=True, check=True)
    peak, estimate = map(int, done.stdout.split())
    assert peak <= estimate + 16 * 2**20
    assert estimate <= 4 * peak + 16 * 2**20


def test_block_jacobian_of_a_language_models_logits(rng):
    """dZ/dW of the logits (L vocab, n) against jacrev of the definition: the top layer's and ln_f's
    parameters from the per-token factors, and so a lower layer's norm's and biases' (their vec [1],
    mixed by the upper attention; b_Q's right factor applied there but kept on the residual path,
    the sum's two sides added as U_t); a lower layer's weight, the positions' and the tied
    embedding's from one forward tangent per entry (the factors do not reach them)."""
    spec, params, s = _model(rng, "small")
    ids = rng.integers(0, s["vocab"], size=s["L"])
    named = {n: ref.t(a) for n, a in zip(params.names, params.arrays)}
    for name in ("h.1.W_1", "h.1.b_Q", "ln_f.gamma", "h.0.gamma_1", "h.0.b_Q", "h.0.b_V", "h.0.W_Q", "wpe", "wte"):
        J = blockhess.block_jacobian(ids, params, name, eps=EPS)
        assert J.shape == (s["L"] * s["vocab"], params[name].size)

        def logits(w):
            return stack(torch.as_tensor(ids), spec, {**named, name: w}, EPS).reshape(-1)

        assert ref.rel_err(J, torch.func.jacrev(logits)(named[name]).reshape(J.shape).numpy()) <= 1e-12
