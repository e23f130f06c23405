"""Exact curvature of whole models: the dense Hessian over every parameter of a stack, a language
model and a ViT, with every cross-layer block, its outer (Gauss-Newton) and functional parts, its
per-layer blocks, and the exact diagonal and traces; and the labelled estimates offered where the
exact ones cost too much.

The parameters below the last block's attention (a lower block, an embedding, positions, a class
token) are out of the per-token factors' reach, so their rows come from one exact Hessian-vector
product per parameter (docs/derivation.md §5.4). The references are torch autograd of the same
models written from their definition (the torch reference's stack), float64:
- the full Hessian by reverse over reverse (jacrev of jacrev: no forward-mode AD, which torch's
  native LayerNorm gets wrong in torch 2.13, docs/errata.md; the reference writes LayerNorm from its
  definition anyway);
- the outer part from its definition, J^T H_l J, with J the Jacobian of the model's output and H_l
  the loss's Hessian in that output, both by reverse mode;
relative error <= 1e-10, and the reference itself checked symmetric.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as ref
import blockhess
from blockhess import BlockParams, BlockSpec, Estimate, ModelSpec
from blockhess._torch_reference import loss as reference_loss
from blockhess._torch_reference import stack

EPS = 1e-5
GPT2_LIKE = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                      activation="gelu_tanh", causal=True, eps=EPS)
VIT_BLOCK = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                      eps=EPS)


def _first_token_loss(Z, target, kind):
    """The class-token ViT's loss: cross-entropy of each sample's first token's logits."""
    return torch.nn.functional.cross_entropy(Z[..., 0, :], target)


def _problem(name: str, rng):
    """(params, X, target, loss, the reference loss of the output, the model's output as a
    function of the flat parameters) for a 2-layer encoder, a 2-layer GPT-2 language model (wte tied
    to its LM head) and a 2-layer ViT with a class token."""
    seed = int(rng.integers(1 << 30))
    if name == "encoder":
        spec = ModelSpec(GPT2_LIKE, n_layers=2, final_norm=True)
        params = BlockParams.random(spec, d=6, d_k=3, d_ff=7, seed=seed)
        X, target, loss = rng.standard_normal((2, 4, 6)), rng.integers(0, 6, size=(2, 4)), "cross_entropy"
        of_output = reference_loss
    elif name == "language model":
        spec = ModelSpec(GPT2_LIKE, n_layers=2, final_norm=True, vocab_size=11, n_positions=7, lm_head=True)
        params = BlockParams.random(spec, d=6, d_k=3, d_ff=7, seed=seed)
        X = rng.integers(0, 11, size=(2, 5))
        target, loss, of_output = X.copy(), "next_token", reference_loss
        target[0, 3] = -100  # an ignored label
    else:
        spec = ModelSpec(VIT_BLOCK, n_layers=2, final_norm=True, patch_dim=4, n_positions=6, classes=3,
                         class_token=True)
        params = BlockParams.random(spec, d=6, d_k=3, d_ff=7, seed=seed)
        X, target, loss = rng.standard_normal((3, 5, 4)), rng.integers(0, 3, size=3), "pooled_cross_entropy"
        of_output = _first_token_loss

    def output(v):
        named = {n: v[sl].reshape(shape) for (n, sl), shape in zip(params.slices().items(), params.shapes)}
        return stack(torch.as_tensor(X), spec, named, EPS)

    return params, X, target, loss, (lambda Z: of_output(Z, torch.as_tensor(target), loss)), output


MODELS = ["encoder", "language model", "vit"]


@pytest.mark.parametrize("name", MODELS)
def test_the_dense_hessian_of_a_whole_model_matches_reverse_over_reverse(rng, name):
    params, X, target, loss, of_output, output = _problem(name, rng)
    flat = ref.t(params.flatten())
    ref_H = torch.func.jacrev(torch.func.jacrev(lambda v: of_output(output(v))))(flat).numpy()
    assert ref.rel_err(ref_H, ref_H.T) <= 1e-14  # the reference is a Hessian
    H = blockhess.loss_hessian(X, target, params, loss=loss)
    assert H.shape == (params.size, params.size) and np.array_equal(H, H.T)
    assert ref.rel_err(H, ref_H) <= 1e-10
    # Every cross-layer block on its own, not only the whole: the lowest against the highest layer.
    low, high = params.slices()[params.names[0]], params.slices()["h.1.W_2"]
    assert ref.rel_err(H[low, high], ref_H[low, high]) <= 1e-10

    Z = output(flat)
    J = torch.func.jacrev(output)(flat).reshape(-1, params.size)
    H_l = torch.func.jacrev(torch.func.jacrev(of_output))(Z).reshape(Z.numel(), Z.numel())
    ref_outer = (J.T @ H_l @ J).numpy()
    outer = blockhess.loss_hessian(X, target, params, loss=loss, part="outer")
    functional = blockhess.loss_hessian(X, target, params, loss=loss, part="functional")
    assert ref.rel_err(outer, ref_outer) <= 1e-10 and np.array_equal(outer, outer.T)
    assert ref.rel_err(outer + functional, H) <= 1e-12


@pytest.mark.parametrize("name", MODELS)
def test_per_layer_blocks_diagonals_and_traces_agree_with_the_whole(rng, name):
    params, X, target, loss, _, _ = _problem(name, rng)
    H = blockhess.loss_hessian(X, target, params, loss=loss)
    where = params.slices()
    first = params.names[0]  # wte, the patch embedding's W_E, or the encoder's h.0.W_Q
    wrt = ("h.0", "ln_f") if first.startswith("h.") else ("h.0", first, "ln_f")
    blocks = blockhess.loss_hessian(X, target, params, loss=loss, wrt=wrt, layout="blocks")
    names = [n for n in params.names if n.startswith(("h.0.", "ln_f.")) or n == first]
    assert {a for a, _ in blocks} == set(names)
    for (a, b), block in blocks.items():
        assert ref.rel_err(block, H[where[a], where[b]]) <= 1e-12, (a, b)

    op = blockhess.hessian_operator(X, target, params, loss=loss)
    assert ref.rel_err(op.diagonal(), np.diag(H)) <= 1e-12
    assert abs(op.trace() - np.trace(H)) <= 1e-12 * np.abs(np.diag(H)).sum()
    traces = op.trace(by_block=True)
    assert list(traces) == [(n, n) for n in params.names]
    for n in params.names:
        exact = np.trace(H[where[n], where[n]])
        assert abs(traces[n, n] - exact) <= 1e-12 * max(np.abs(np.diag(H[where[n], where[n]])).sum(), 1e-300), n
    # A lower layer alone, through the same products: its diagonal and its block of the whole.
    lower = blockhess.hessian_operator(X, target, params, loss=loss, wrt=("h.0",))
    rows = np.concatenate([np.arange(where[n].start, where[n].stop) for n in params.names if n.startswith("h.0.")])
    assert ref.rel_err(lower.diagonal(), np.diag(H)[rows]) <= 1e-12


def test_hutchinsons_estimates_are_labelled_and_their_standard_errors_honest(rng):
    """Over 200 seeds the exact trace lies within two standard errors of the estimate about 95% of
    the time (a standard error that is too small fails the lower bound, one too large the upper),
    and so does each entry of the diagonal over 20 seeds."""
    params, X, target, loss, _, _ = _problem("encoder", rng)
    op = blockhess.hessian_operator(X, target, params, loss=loss)
    exact_trace, exact_diagonal = op.trace(), op.diagonal()
    estimates = [op.trace(exact=False, probes=20, seed=s) for s in range(200)]
    assert all(isinstance(e, Estimate) and e.probes == 20 and e.standard_error > 0 for e in estimates)
    covered = np.mean([abs(e.value - exact_trace) <= 2 * e.standard_error for e in estimates])
    assert 0.88 <= covered <= 0.995, covered
    hits = []
    for s in range(20):
        e = op.diagonal(exact=False, probes=20, seed=s)
        assert e.value.shape == e.standard_error.shape == (params.size,)
        hits.append(np.abs(e.value - exact_diagonal) <= 2 * e.standard_error + 1e-15)
    assert 0.88 <= np.mean(hits) <= 0.995, np.mean(hits)
    by_block = op.trace(by_block=True, exact=False, probes=20, seed=3)
    assert list(by_block) == [(n, n) for n in params.names] and all(isinstance(e, Estimate) for e in by_block.values())
    # The blocks' estimates come from the same probes as the whole's: they add up to it.
    whole = op.trace(exact=False, probes=20, seed=3)
    assert abs(sum(e.value for e in by_block.values()) - whole.value) <= 1e-9 * abs(whole.value) + 1e-12
    # The same seed gives the same estimate; another seed another.
    assert op.trace(exact=False, probes=20, seed=3) == whole != op.trace(exact=False, probes=20, seed=4)


def test_hutch_plus_plus_is_exact_where_its_sketch_spans_and_its_standard_error_honest(rng):
    """Hutch++ takes the trace of its sketch's span exactly: over a block of 6 parameters with 10
    sketch columns it is the exact trace, its residual nothing. Over the whole model, 100 seeds at
    30 probes (10 residual probes: two standard errors cover about 92% under Student's t), the exact
    trace lies within two standard errors about that often."""
    params, X, target, loss, _, _ = _problem("encoder", rng)
    small = blockhess.hessian_operator(X, target, params, loss=loss, wrt=("h.1.b_O",))
    assert small.shape == (6, 6)
    e = small.trace(exact=False, probes=30, method="hutch++")
    assert isinstance(e, Estimate) and e.probes == 30
    assert abs(e.value - small.trace()) <= 1e-12 * abs(small.trace()) and e.standard_error <= 1e-12 * abs(e.value)
    op = blockhess.hessian_operator(X, target, params, loss=loss)
    exact_trace = op.trace()
    estimates = [op.trace(exact=False, probes=30, seed=s, method="hutch++") for s in range(100)]
    covered = np.mean([abs(e.value - exact_trace) <= 2 * e.standard_error for e in estimates])
    assert 0.8 <= covered <= 0.995, covered
    assert op.trace(exact=False, probes=30, seed=5, method="hutch++") == estimates[5]


def test_an_exact_diagonal_beyond_the_product_limit_is_refused_and_names_the_estimate(rng, monkeypatch):
    """The limit counts the entries the factors do not reach, which alone take products."""
    params, X, target, loss, _, _ = _problem("encoder", rng)
    top = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")))
    monkeypatch.setattr(blockhess.hvp, "EXACT_PRODUCTS_LIMIT", 10)
    with pytest.raises(ValueError, match=r"h\.0\.W_Q moves the input of an attention.*one Hessian-vector product "
                                         r"per entry the factors do not reach, \d+ above the limit of 10.*exact=False"):
        blockhess.hessian_operator(X, target, params, loss=loss).diagonal()
    with pytest.raises(ValueError, match="exact=False"):
        blockhess.hessian_operator(X, target, params, loss=loss, wrt=("h.0.W_Q", "h.1")).trace()
    # Only the entries the factors do not reach take products: h.0.b_Q's few, under the limit, beside
    # the top layer's from its factors; the diagonal of the dense matrix (from products alone).
    mixed = ("h.0.b_Q", "h.1")
    assert params["h.0.b_Q"].size <= 10
    diagonal = blockhess.hessian_operator(X, target, params, loss=loss, wrt=mixed).diagonal()
    exact = np.diag(blockhess.loss_hessian(X, target, params, loss=loss, wrt=mixed))
    assert np.abs(diagonal - exact).max() <= 1e-12 * np.abs(exact).max()
    # The last layer's factors reach: no products, no limit.
    top_size = sum(params.slices()[n].stop - params.slices()[n].start for n in top)
    assert blockhess.hessian_operator(X, target, params, loss=loss, wrt=top).diagonal().shape == (top_size,)
    estimate = blockhess.hessian_operator(X, target, params, loss=loss).trace(exact=False, probes=4)
    assert isinstance(estimate, Estimate)


def test_bad_estimate_arguments_are_refused_by_name(rng):
    params, X, target, loss, _, _ = _problem("encoder", rng)
    op = blockhess.hessian_operator(X, target, params, loss=loss, wrt=("h.1.W_1",))
    with pytest.raises(TypeError, match="exact must be True or False"):
        op.diagonal(exact="no")
    with pytest.raises(ValueError, match="probes must be at least 2"):
        op.trace(exact=False, probes=1)
    with pytest.raises(TypeError, match="probes must be an integer"):
        op.trace(exact=False, probes=2.5)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        op.diagonal(exact=False, seed=-1)
    with pytest.raises(ValueError, match="method must be one of"):
        op.trace(exact=False, method="hutch+")
    with pytest.raises(ValueError, match="method='hutch\\+\\+' estimates the whole trace"):
        op.trace(by_block=True, exact=False, method="hutch++")
    with pytest.raises(ValueError, match="at least 4 for method='hutch\\+\\+'"):
        op.trace(exact=False, probes=3, method="hutch++")


def test_estimates_of_a_torch_built_operator_are_torch_tensors(rng):
    params, X, target, loss, _, _ = _problem("encoder", rng)
    op = blockhess.hessian_operator(torch.as_tensor(X), torch.as_tensor(target), params, loss=loss, wrt=("h.1.W_1",))
    e = op.diagonal(exact=False, probes=3)
    assert isinstance(e.value, torch.Tensor) and isinstance(e.standard_error, torch.Tensor)
