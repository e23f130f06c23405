"""Each node of the curvature engine (cpp/include/blockhess/engine/nodes/) against torch autograd.

A short chain of nodes is run by the engine (engine_chain of the private test module _engine_nodes,
built once beside the _core levels) and differentiated for the scalar l = <G, out>: the gradient
exercises every node's vjp; the dense Hessian exercises push (the factors) and curvature (its
sites and bilinear terms) of every node the parameters pass; the Hessian-vector product
exercises jvp and vjp_tangent. The same chain is written in torch from
the nodes' definitions; float64, relative error <= 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as ref
import blockhess.spec
from blockhess import _engine_nodes


ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


def _causal_attention(X, WQ, WK, WV):
    T = (X @ WQ) @ (X @ WK).transpose(-1, -2) / np.sqrt(WQ.shape[1])
    L = T.shape[-1]
    T = T.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1), float("-inf"))
    return torch.softmax(T, dim=-1) @ (X @ WV)


def _torch_chain(kinds, X, params, eps):
    cur, before, k = X, None, 0
    for kind in kinds:
        start = cur
        if kind == "linear":
            cur, k = cur @ params[k], k + 1
        elif kind == "linear_bias":
            cur, k = cur @ params[k] + params[k + 1][0], k + 2
        elif kind in ACTIVATIONS:
            cur = ACTIVATIONS[kind](cur)
        elif kind == "layernorm":
            cur = ref.layernorm(cur, eps)
        elif kind in ("rmsnorm", "rmsnorm_affine"):
            cur = cur / torch.sqrt((cur * cur).mean(-1, keepdim=True) + eps)
            if kind == "rmsnorm_affine":
                cur, k = cur * params[k][0], k + 1
        elif kind == "layernorm_affine":
            cur, k = ref.layernorm(cur, eps, params[k][0], params[k + 1][0]), k + 2
        elif kind == "residual":
            cur = cur + before
        elif kind == "attention":
            cur, k = ref.attention(cur, params[k], params[k + 1], params[k + 2]), k + 3
        elif kind in ("attention_bias", "attention_2heads"):
            WQ, bQ, WK, bK, WV, bV = params[k:k + 6]
            Q, K, V = cur @ WQ + bQ[0], cur @ WK + bK[0], cur @ WV + bV[0]
            h = 2 if kind == "attention_2heads" else 1
            dk, dv = Q.shape[-1] // h, V.shape[-1] // h
            heads = []
            for i in range(h):
                T = Q[..., i * dk:(i + 1) * dk] @ K[..., i * dk:(i + 1) * dk].transpose(-1, -2) / np.sqrt(dk)
                heads.append(torch.softmax(T, dim=-1) @ V[..., i * dv:(i + 1) * dv])
            cur, k = torch.cat(heads, dim=-1), k + 6
        elif kind == "attention_causal":
            cur, k = _causal_attention(cur, params[k], params[k + 1], params[k + 2]), k + 3
        before = start
    return cur


# (chain, parameter shapes as functions of d): each node appears between parameters, so that both
# its own curvature and the factors it carries reach the Hessian.
CHAINS = {
    "linear-linear": (["linear", "linear"], [(5, 4), (4, 3)]),
    "linear-relu-linear": (["linear", "relu", "linear"], [(5, 6), (6, 3)]),
    "linear-layernorm-linear": (["linear", "layernorm", "linear"], [(5, 4), (4, 3)]),
    # relu(h) + h: the parameter reaches both inputs of the sum (identity + diagonal factors)
    "linear-relu-residual-linear": (["linear", "relu", "residual", "linear"], [(5, 5), (5, 3)]),
    "linear-layernorm": (["linear", "layernorm"], [(5, 4)]),
    "attention": (["attention"], [(5, 3), (5, 3), (5, 4)]),
    "attention-linear-layernorm": (["attention", "linear", "layernorm"], [(5, 3), (5, 3), (5, 5), (5, 4)]),
    "attention-residual-layernorm": (["attention", "residual", "layernorm", "linear"], [(5, 3), (5, 3), (5, 5), (5, 2)]),
    # the block family's node options
    "linear_bias-gelu-linear_bias": (["linear_bias", "gelu", "linear_bias"], [(5, 6), (1, 6), (6, 3), (1, 3)]),
    "linear-gelu_tanh-linear": (["linear", "gelu_tanh", "linear"], [(5, 6), (6, 3)]),
    "linear-silu-residual-linear": (["linear", "silu", "residual", "linear"], [(5, 5), (5, 3)]),
    "linear-layernorm_affine-linear": (["linear", "layernorm_affine", "linear"], [(5, 4), (1, 4), (1, 4), (4, 3)]),
    "linear_bias-layernorm_affine": (["linear_bias", "layernorm_affine"], [(5, 4), (1, 4), (1, 4), (1, 4)]),
    "attention_bias-linear": (["attention_bias", "linear"], [(5, 3), (1, 3), (5, 3), (1, 3), (5, 4), (1, 4), (4, 3)]),
    "attention_bias-residual-layernorm_affine": (["attention_bias", "residual", "layernorm_affine"],
                                                 [(5, 3), (1, 3), (5, 3), (1, 3), (5, 5), (1, 5), (1, 5), (1, 5)]),
    "attention_2heads-layernorm-linear": (["attention_2heads", "layernorm", "linear"],
                                          [(5, 4), (1, 4), (5, 4), (1, 4), (5, 6), (1, 6), (6, 3)]),
    "attention_2heads-linear_bias-residual": (["attention_2heads", "linear_bias", "residual", "layernorm_affine"],
                                              [(5, 4), (1, 4), (5, 4), (1, 4), (5, 6), (1, 6), (6, 6), (1, 6),
                                               (1, 6), (1, 6)]),
    "linear-rmsnorm-linear": (["linear", "rmsnorm", "linear"], [(5, 4), (4, 3)]),
    "linear-rmsnorm_affine-linear": (["linear", "rmsnorm_affine", "linear"], [(5, 4), (1, 4), (4, 3)]),
    "rmsnorm_affine-attention-linear": (["rmsnorm_affine", "attention", "linear"], [(1, 5), (5, 3), (5, 3), (5, 4), (4, 2)]),
    # parameters that move the attention's input (a pre-LN block's gamma_1, beta_1): mixed tokens
    "layernorm_affine-attention-linear": (["layernorm_affine", "attention", "linear"],
                                          [(1, 5), (1, 5), (5, 3), (5, 3), (5, 4), (4, 2)]),
    "layernorm_affine-attention_2heads-layernorm-linear": (["layernorm_affine", "attention_2heads", "layernorm", "linear"],
                                                           [(1, 5), (1, 5), (5, 4), (1, 4), (5, 4), (1, 4), (5, 6), (1, 6),
                                                            (6, 2)]),
    "attention_causal-layernorm_affine-linear_bias": (["attention_causal", "layernorm_affine", "linear_bias"],
                                                      [(5, 3), (5, 3), (5, 5), (1, 5), (1, 5), (5, 2), (1, 2)]),
}


def _chain_case(rng, name, B, eps):
    kinds, shapes = CHAINS[name]
    X = rng.standard_normal((B, 4, 5))
    params = [rng.standard_normal(s) / np.sqrt(s[0]) * 1.5 + (s[0] == 1) * 0.5 for s in shapes]
    out = _torch_chain(kinds, ref.t(X), [ref.t(p) for p in params], eps)
    G = rng.standard_normal(tuple(out.shape))
    return kinds, X, params, G


def _selection(n, pattern):
    return [pattern == "all" or (pattern == "first" and i == 0) or (pattern == "last" and i == n - 1) for i in range(n)]


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("pattern", ["all", "first", "last"])
def test_chain_matches_autograd(rng, name, B, pattern):
    eps = 1e-3 if B == 2 else 0.0
    kinds, X, params, G = _chain_case(rng, name, B, eps)
    wrt = _selection(len(params), pattern)
    sizes = [p.size for p in params]
    P = sum(s for s, w in zip(sizes, wrt) if w)
    V = rng.standard_normal((P, 3))
    out, grad, H, HV = _engine_nodes.engine_chain(kinds, X, params, eps, G, wrt, V)

    shapes = [p.shape for p in params]
    flat = ref.t(np.concatenate([p.ravel() for p in params]))
    offsets = np.cumsum([0] + sizes)
    chosen = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in range(len(params)) if wrt[i]])

    def scalar(v):
        ws = [v[offsets[i]:offsets[i + 1]].reshape(shapes[i]) for i in range(len(params))]
        return (_torch_chain(kinds, ref.t(X), ws, eps) * ref.t(G)).sum()

    ref_out = _torch_chain(kinds, ref.t(X), [ref.t(p) for p in params], eps).numpy()
    ref_grad = torch.func.grad(scalar)(flat).numpy()
    ref_H = torch.func.hessian(scalar)(flat).numpy()[np.ix_(chosen, chosen)]
    assert ref.rel_err(out, ref_out) <= 1e-13
    assert ref.rel_err(grad, ref_grad) <= 1e-12
    assert ref.rel_err(H, ref_H) <= 1e-10
    assert np.array_equal(H, H.T)  # each pair assembled once, then mirrored
    assert ref.rel_err(HV, ref_H @ V) <= 1e-10


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_smooth_activations_hold_their_accuracy_far_from_zero(rng, activation):
    """Pre-activations spread over [-12, 12], where 1 + tanh(u) would cancel (gelu_tanh at x << 0 is
    computed through sigma(2u)) and where exp(-2u) overflows: value, gradient, Hessian and H v
    against torch in float64."""
    kinds = ["linear", activation, "linear"]
    X = np.linspace(-12.0, 12.0, 2 * 6 * 5).reshape(2, 6, 5)
    params = [np.eye(5) + 0.01 * rng.standard_normal((5, 5)), rng.standard_normal((5, 3))]
    G = rng.standard_normal((2, 6, 3))
    V = rng.standard_normal((40, 2))
    out, grad, H, HV = _engine_nodes.engine_chain(kinds, X, params, 0.0, G, [True, True], V)
    flat = ref.t(np.concatenate([p.ravel() for p in params]))

    def scalar(v):
        return (_torch_chain(kinds, ref.t(X), [v[:25].reshape(5, 5), v[25:].reshape(5, 3)], 0.0) * ref.t(G)).sum()

    ref_out = _torch_chain(kinds, ref.t(X), [ref.t(p) for p in params], 0.0).numpy()
    ref_H = torch.func.hessian(scalar)(flat).numpy()
    assert ref.rel_err(out, ref_out) <= 1e-13
    assert ref.rel_err(grad, torch.func.grad(scalar)(flat).numpy()) <= 1e-12
    assert ref.rel_err(H, ref_H) <= 1e-10
    assert ref.rel_err(HV, ref_H @ V) <= 1e-10


def test_identity_and_diagonal_factor_forms_are_exercised(rng):
    """A linear map right after another (identity factor) and after relu (diagonal factor) reach the
    bilinear term through kron::accumulate_diagonal: both pieces are non-zero here and correct."""
    kinds, X, params, G = _chain_case(rng, "linear-relu-linear", 1, 0.0)
    _, _, H, _ = _engine_nodes.engine_chain(kinds, X, params, 0.0, G, [True, True], np.zeros((sum(p.size for p in params), 1)))
    cross = H[: params[0].size, params[0].size:]
    assert np.abs(cross).max() > 1e-3


def test_float32_chain_is_close_to_float64(rng):
    kinds, X, params, G = _chain_case(rng, "attention-residual-layernorm", 2, 1e-3)
    P = sum(p.size for p in params)
    V = rng.standard_normal((P, 2))
    wrt = [True] * len(params)
    _, g64, H64, HV64 = _engine_nodes.engine_chain(kinds, X, params, 1e-3, G, wrt, V)
    f32 = [a.astype(np.float32) for a in (X, G, V)]
    _, g32, H32, HV32 = _engine_nodes.engine_chain(kinds, f32[0], [p.astype(np.float32) for p in params], np.float32(1e-3),
                                           f32[1], wrt, f32[2])
    assert H32.dtype == np.float32
    for a, b in ((g32, g64), (H32, H64), (HV32, HV64)):
        assert ref.rel_err(a, b) <= 1e-4


def test_bad_chains_are_refused(rng):
    X = rng.standard_normal((1, 3, 4))
    W = rng.standard_normal((4, 4))
    G = np.zeros((1, 3, 4))
    V = np.zeros((16, 1))
    with pytest.raises(ValueError, match="unknown node"):
        _engine_nodes.engine_chain(["softplus"], X, [W], 0.0, G, [True], V)
    with pytest.raises(ValueError, match="too few parameters"):
        _engine_nodes.engine_chain(["linear", "linear"], X, [W], 0.0, G, [True], V)
    with pytest.raises(ValueError, match="more parameters"):
        _engine_nodes.engine_chain([], X, [W], 0.0, np.zeros((1, 3, 4)), [True], V)
    with pytest.raises(ValueError, match="residual"):
        _engine_nodes.engine_chain(["residual"], X, [W], 0.0, G, [True], V)


# ---- the heads (engine/heads/): a loss at the chain's output -------------------------------------

HEAD_CHAINS = {
    # a smooth chain: the head's curvature meets the nodes' (outer and functional parts both non-zero)
    "linear-gelu-linear": (["linear", "gelu", "linear"], [(5, 6), (6, 4)]),
    # the output is a LayerNorm's: the head's site is pulled back through it
    "attention_bias-linear-layernorm_affine": (["attention_bias", "linear", "layernorm_affine"],
                                               [(5, 3), (1, 3), (5, 3), (1, 3), (5, 4), (1, 4), (4, 4), (1, 4), (1, 4)]),
}


@pytest.mark.parametrize("chain", sorted(HEAD_CHAINS))
@pytest.mark.parametrize("loss", blockhess.spec.loss_names())
@pytest.mark.parametrize("B", [1, 3])
def test_heads_match_autograd(rng, chain, loss, B):
    """Each head's forward (the loss), vjp (the gradient), curvature (its site in the dense Hessian)
    and vjp_tangent (the Hessian-vector product's seed) against the loss written in torch from its
    definition, float64, relative error <= 1e-10; the Hessian symmetric bit for bit."""
    kinds, shapes = HEAD_CHAINS[chain]
    X = rng.standard_normal((B, 4, 5))
    params = [rng.standard_normal(s) / np.sqrt(s[0]) * 1.5 + (s[0] == 1) * 0.5 for s in shapes]
    width, classes = shapes[-1][1], 3
    values = classes_arg = W_C = b_C = None
    if loss == "mse":
        values = rng.standard_normal((B, 4, width))
    elif loss == "cross_entropy":
        classes_arg = rng.integers(0, width, size=(B, 4))
    elif loss == "next_token":  # labels, some ignored (-100); the loss reads each token's next one
        classes_arg = rng.integers(0, width, size=(B, 4))
        classes_arg[:, 2] = -100
    else:
        classes_arg = rng.integers(0, classes, size=B)
        W_C, b_C = rng.standard_normal((width, classes)), rng.standard_normal(classes)
    target = values if loss == "mse" else classes_arg
    head = None if W_C is None else (ref.t(W_C), ref.t(b_C))
    sizes = [p.size for p in params]
    offsets = np.cumsum([0] + sizes)
    V = rng.standard_normal((sum(sizes), 2))
    code = blockhess.spec.loss_names().index(loss)
    value, grad, H, HV = _engine_nodes.engine_head(kinds, X, params, 0.0, code, values, classes_arg, W_C, b_C,
                                                   [True] * len(params), V)

    def scalar(v):
        ws = [v[offsets[i]:offsets[i + 1]].reshape(shapes[i]) for i in range(len(params))]
        return ref.block_loss(_torch_chain(kinds, ref.t(X), ws, 0.0), torch.as_tensor(target), loss, head)

    flat = ref.t(np.concatenate([p.ravel() for p in params]))
    ref_H = torch.func.hessian(scalar)(flat).numpy()
    assert ref.rel_err(np.asarray(value), scalar(flat).numpy()) <= 1e-13
    assert ref.rel_err(grad, torch.func.grad(scalar)(flat).numpy()) <= 1e-12
    assert ref.rel_err(H, ref_H) <= 1e-10
    assert np.array_equal(H, H.T)
    assert ref.rel_err(HV, ref_H @ V) <= 1e-10


def test_heads_refuse_what_they_cannot_take(rng):
    X = rng.standard_normal((1, 3, 4))
    W = rng.standard_normal((4, 4))
    V = np.zeros((16, 1))
    with pytest.raises(ValueError, match="unknown code 7"):
        _engine_nodes.engine_head(["linear"], X, [W], 0.0, 7, X, None, None, None, [True], V)
    with pytest.raises(ValueError, match="mse needs a float target"):
        _engine_nodes.engine_head(["linear"], X, [W], 0.0, 0, None, None, None, None, [True], V)
    with pytest.raises(ValueError, match=r"class index 4 is out of range \[0, 4\)"):
        _engine_nodes.engine_head(["linear"], X, [W], 0.0, 1, None, np.array([[0, 4, 1]]), None, None, [True], V)
    with pytest.raises(ValueError, match=r"needs a head \(W_C, b_C\)"):
        _engine_nodes.engine_head(["linear"], X, [W], 0.0, 2, None, np.array([0]), None, None, [True], V)
