"""Cross-entropy over logits whose gaps exceed the float range of exp: the loss is formed as
log-sum-exp minus the class's logit, never as -log p[class] (p[class] underflows to 0 once the gap
passes about 745 in float64, and -log 0 = Inf was refused as a non-finite result). Every entry point
that forms a cross-entropy value (loss, gradient, Hessian, HVP, operator; per token and pooled) is
checked against the torch reference written from the definition (blockhess._torch_reference.loss,
F.cross_entropy, which is log-sum-exp based) in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import blockhess
import reference as ref
from blockhess import BlockParams, BlockSpec
from blockhess import _torch_reference as torch_reference

# Pre-LN has no norm after its last residual, so the logits Z grow with X: rows of 1000 N(0, 1)
# entries span gaps of well over 745.
PRE_LN = BlockSpec(norm_position="pre")
L, D, D_K, D_FF, B, CLASSES = 3, 5, 3, 6, 2, 4


def _per_token_case():
    rng = np.random.default_rng(7)
    params = BlockParams.random(PRE_LN, d=D, d_k=D_K, d_ff=D_FF, seed=3)
    X = 1000.0 * rng.standard_normal((B, L, D))
    Z = blockhess.block_forward(X, params)
    target = Z.argmin(axis=-1)  # the least likely class of every token: p[class] underflows
    gaps = Z.max(axis=-1) - Z.min(axis=-1)
    assert gaps.min() > 800, gaps  # the regime the test is about
    return X, target, params, None


def _pooled_case():
    rng = np.random.default_rng(8)
    params = BlockParams.random(d=D, d_k=D_K, d_ff=D_FF, seed=4)
    X = rng.standard_normal((B, L, D))
    W_C = rng.standard_normal((D, CLASSES))
    b_C = np.array([0.0, 1000.0, -200.0, 300.0])  # class 0 trails class 1 by about 1000 in every sample
    return X, np.zeros(B, dtype=np.int64), params, (W_C, b_C)


CASES = {"cross_entropy": _per_token_case, "pooled_cross_entropy": _pooled_case}


def _torch_loss_of_flat(X, target, params, head, loss):
    output_of = torch_reference.family_of_flat(ref.t(X), params.spec, params.names, params.shapes)
    torch_head = None if head is None else tuple(ref.t(a) for a in head)
    t = torch.as_tensor(target)
    return lambda v: torch_reference.loss(output_of(v), t, loss, torch_head)


@pytest.mark.parametrize("loss", sorted(CASES))
def test_value_gradient_and_hessian_match_torch_beyond_exp_range(loss):
    """loss_value, loss_gradient and the dense loss_hessian stay finite and exact where p[class] = 0."""
    X, target, params, head = CASES[loss]()
    f = _torch_loss_of_flat(X, target, params, head, loss)
    v = ref.t(params.flatten())
    value = float(f(v))
    assert value > 745  # torch's own value: far beyond -log of the smallest float64
    assert blockhess.loss_value(X, target, params, loss=loss, head=head) == pytest.approx(value, rel=1e-13)
    gradient = blockhess.loss_gradient(X, target, params, loss=loss, head=head)
    assert ref.rel_err(gradient, torch.func.grad(f)(v).numpy()) < 1e-10
    # Reverse over reverse: the definition-written norms, no forward-mode LayerNorm (guide: environment).
    H_torch = torch.func.jacrev(torch.func.jacrev(f))(v).numpy()
    H = blockhess.loss_hessian(X, target, params, loss=loss, head=head)
    assert np.array_equal(H, H.T)
    assert ref.rel_err(H, H_torch, scale=1e-12) < 1e-10


@pytest.mark.parametrize("loss", sorted(CASES))
def test_hvp_and_operator_match_torch_beyond_exp_range(loss):
    """loss_hvp and hessian_operator (its products and its loss value) in the same regime."""
    X, target, params, head = CASES[loss]()
    f = _torch_loss_of_flat(X, target, params, head, loss)
    v = ref.t(params.flatten())
    V = np.random.default_rng(1).standard_normal((params.size, 2))
    expected = torch.func.jacrev(torch.func.jacrev(f))(v).numpy() @ V
    scale = np.linalg.norm(expected)
    assert np.linalg.norm(blockhess.loss_hvp(X, target, params, V, loss=loss, head=head) - expected) <= 1e-10 * scale
    op = blockhess.hessian_operator(X, target, params, loss=loss, head=head)
    assert np.linalg.norm(op @ V - expected) <= 1e-10 * scale
    assert op.loss_value == pytest.approx(float(f(v)), rel=1e-13)


def test_float32_cross_entropy_beyond_exp_range():
    """float32 underflows earlier (gaps of about 104): the value is still torch's, to float32 rounding."""
    X, target, params, _ = _per_token_case()
    params32 = BlockParams.from_arrays(params.spec, {n: np.asarray(params[n], np.float32) for n in params.names})
    X32 = X.astype(np.float32)
    Z = torch.as_tensor(blockhess.block_forward(X32, params32), dtype=torch.float64)
    expected = float(torch.nn.functional.cross_entropy(Z.reshape(-1, D), torch.as_tensor(target).reshape(-1)))
    assert blockhess.loss_value(X32, target, params32, loss="cross_entropy") == pytest.approx(expected, rel=1e-5)
