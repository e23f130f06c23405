"""The blocks of the family (blockhess.BlockSpec) and their loss derivatives, written directly in
PyTorch. The paper's post-LN block (docs/derivation.md §2.1) is the family's default spec:

    T = X W_Q W_K^T X^T / sqrt(d_k),  A = softmax_rows(T),  F = A X W_V
    Y = LN(X + F),  S = relu(Y W_1) W_2 + Y,  Z = LN(S)

LN is row-wise over the last axis, population variance, ``eps`` inside the square root, no affine
parameters inside the paper's block. Losses: "mse" = mean of (Z - target)^2 over every entry (and sample);
"cross_entropy" = mean over tokens (and samples) of the cross-entropy of the rows of Z as logits;
"pooled_cross_entropy" = mean over samples of the cross-entropy of mean_tokens(Z) W_C + b_C, with
head = (W_C, b_C) fixed and one class per sample.

The one independent reference of the package: the tests, ``blockhess check`` and the benchmarks
compare blockhess's closed forms against it. Derivatives come from autograd, never from blockhess's
formulas. Private, and it imports torch: ``import blockhess`` never imports it.

Device- and dtype-agnostic: tensors are computed on where they are, in their dtype; NumPy arrays
are accepted and converted with ``torch.as_tensor``. ``weights`` are W_Q, W_K, W_V, W_1, W_2; a flat
parameter vector holds them in that order, each vec_r'd (``reshape(-1)``).
"""

from __future__ import annotations

import math

import torch
from torch.func import grad, hessian, jacrev, jvp, vjp

from .block import PARAM_NAMES  # the parameter registry (params.hpp), the one table of names
from .spec import PAPER_BLOCK
LOSSES = ("mse", "cross_entropy", "pooled_cross_entropy", "next_token")
PARTS = ("full", "outer", "functional")


# ---- the block ------------------------------------------------------------------------------------


def layernorm(x, eps=0.0, gamma=None, beta=None, *, fused=False):
    """(x - mean) / sqrt(population variance + eps) over the last axis, then * gamma + beta.

    fused=True computes the same function with ``torch.nn.functional.layer_norm`` (2-5x faster under
    ``jacrev``: the benchmarks' baselines use it)."""
    if fused:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], gamma, beta, eps)
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    z = (x - mean) / torch.sqrt(variance + eps)
    if gamma is not None:
        z = z * gamma
    if beta is not None:
        z = z + beta
    return z


def softmax_rows(T):
    return torch.softmax(T, dim=-1)


def attention(X, WQ, WK, WV):
    """The paper's attention: F = softmax_rows(Q K^T / sqrt(d_k)) V with Q, K, V = X W_Q, X W_K,
    X W_V, for X of shape (L, d) or (B, L, d)."""
    return _attention(X, PAPER_BLOCK, {"W_Q": WQ, "W_K": WK, "W_V": WV}.get)


def ffn(Y, W1, W2):
    """The paper's FFN: relu(Y W_1) W_2 (no biases)."""
    return _ffn(Y, PAPER_BLOCK, {"W_1": W1, "W_2": W2}.get)


def block(X, WQ, WK, WV, W1, W2, eps=0.0, *, fused=False):
    """Z of the paper's block for X of shape (L, d) or (B, L, d)."""
    return family_block(X, PAPER_BLOCK, dict(zip(PARAM_NAMES, (WQ, WK, WV, W1, W2))), eps, fused=fused)


def loss(Z, target, kind, head=None):
    """"mse": mean (Z - target)^2; "cross_entropy": mean over tokens of -log softmax(Z row)[class];
    "pooled_cross_entropy": mean over samples of -log softmax(mean_t Z_t W_C + b_C)[class], with
    head = (W_C, b_C)."""
    if kind == "mse":
        return ((Z - target) ** 2).mean()
    if kind == "cross_entropy":
        return torch.nn.functional.cross_entropy(Z.reshape(-1, Z.shape[-1]), target.reshape(-1))
    if kind == "pooled_cross_entropy":  # without a head, Z's rows are a model's own classifier's logits
        logits = Z.mean(-2)
        if head is not None:
            W_C, b_C = (torch.as_tensor(a, dtype=Z.dtype, device=Z.device) for a in head)
            logits = logits @ W_C + b_C
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    if kind == "next_token":  # the causal-LM loss: position i's logits against label i + 1, -100 ignored
        return torch.nn.functional.cross_entropy(Z[..., :-1, :].reshape(-1, Z.shape[-1]),
                                                 target[..., 1:].reshape(-1), ignore_index=-100)
    raise ValueError(f"kind must be one of {LOSSES}, got {kind!r}")


# ---- inputs and flat parameter vectors ------------------------------------------------------------


def as_problem(X, target, weights, kind, *, dtype=None, device=None):
    """(X, target, weights) as tensors: float ones in ``dtype`` (default: X's), on ``device`` (default:
    X's); for the cross-entropies the target as int64 class indices."""
    X = torch.as_tensor(X, dtype=dtype, device=device)
    weights = [torch.as_tensor(w, dtype=X.dtype, device=X.device) for w in weights]
    target_dtype = X.dtype if kind == "mse" else torch.int64
    return X, torch.as_tensor(target, dtype=target_dtype, device=X.device), weights


def flatten(weights):
    return torch.cat([w.reshape(-1) for w in weights])


def unflatten(v, shapes):
    """The matrices of the given shapes, in order, from the flat vector v (views; one split, whose
    backward is one concatenation rather than a zero-padded vector per matrix)."""
    pieces = v.split([rows * cols for rows, cols in shapes])
    return [piece.reshape(shape) for piece, shape in zip(pieces, shapes)]


def loss_of_flat(X, target, shapes, kind, eps=0.0, *, fused=False, head=None):
    """The loss as a function of the flat vector of all five weights (for torch.func.hessian)."""
    return lambda v: loss(block(X, *unflatten(v, shapes), eps=eps, fused=fused), target, kind, head)


def _selected(wrt):
    """Indices of the named weights, in the canonical order."""
    names = PARAM_NAMES if wrt is None else tuple(wrt)
    unknown = [n for n in names if n not in PARAM_NAMES]
    if isinstance(wrt, str) or not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"wrt must be a non-empty sequence of distinct names from {PARAM_NAMES}, got {wrt!r}")
    return [i for i, n in enumerate(PARAM_NAMES) if n in names]


def _output_of_flat(X, weights, eps, wrt):
    """(Z as a function of the flat vector of the weights named in wrt, the others fixed; that vector)."""
    chosen = _selected(wrt)
    shapes = [weights[i].shape for i in chosen]

    def output_of(v):
        ws = list(weights)
        for i, w in zip(chosen, unflatten(v, shapes)):
            ws[i] = w
        return block(X, *ws, eps=eps)

    return output_of, flatten([weights[i] for i in chosen])


def _hvp(f, x, v):
    """(d^2 f / dx^2) v by double backward (reverse over reverse)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
        (hv,) = torch.autograd.grad(g, x, grad_outputs=v)
    return hv.detach()


# ---- loss derivatives -----------------------------------------------------------------------------


def loss_gradient(X, target, weights, kind="mse", eps=0.0, wrt=None, head=None):
    """Gradient of the loss over the flat vector of the weights named in wrt (default: all five)."""
    X, target, weights = as_problem(X, target, weights, kind)
    output_of, v0 = _output_of_flat(X, weights, eps, wrt)
    return grad(lambda v: loss(output_of(v), target, kind, head))(v0)


def loss_hessian(X, target, weights, kind="mse", eps=0.0, part="full", wrt=None, head=None):
    """(P, P) loss Hessian over the weights named in wrt. part "full": torch.func.hessian of the
    loss; "outer" (Gauss-Newton): J^T H_loss J with J = jacrev of Z and H_loss the loss's Hessian in
    Z; "functional": full - outer."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    X, target, weights = as_problem(X, target, weights, kind)
    output_of, v0 = _output_of_flat(X, weights, eps, wrt)
    if part != "outer":
        full = hessian(lambda v: loss(output_of(v), target, kind, head))(v0)
        if part == "full":
            return full
    Z = output_of(v0)
    J = jacrev(output_of)(v0).reshape(Z.numel(), -1)
    H_loss = hessian(lambda z: loss(z.reshape(Z.shape), target, kind, head))(Z.reshape(-1))
    outer = J.T @ H_loss @ J
    return outer if part == "outer" else full - outer


def loss_hvp(X, target, weights, v, kind="mse", eps=0.0, part="full", wrt=None, head=None):
    """Loss Hessian (over the weights named in wrt) times the flat vector v, without forming it.
    part "full": double backward; "outer": J^T (H_loss (J v)) with torch.func.jvp / vjp of Z and
    double backward of the loss in Z; "functional": full - outer."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    X, target, weights = as_problem(X, target, weights, kind)
    output_of, v0 = _output_of_flat(X, weights, eps, wrt)
    v = torch.as_tensor(v, dtype=v0.dtype, device=v0.device).reshape(v0.shape)
    if part != "outer":
        full = _hvp(lambda w: loss(output_of(w), target, kind, head), v0, v)
        if part == "full":
            return full
    Z, Jv = jvp(output_of, (v0,), (v,))
    H_loss_Jv = _hvp(lambda z: loss(z, target, kind, head), Z.detach(), Jv)
    _, pullback = vjp(output_of, v0)
    (outer,) = pullback(H_loss_Jv)
    return outer if part == "outer" else full - outer


# ---- the block family (blockhess.BlockSpec) --------------------------------------------------------

_ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


def _linear(u, get, w, b):
    out = u @ get(w)
    return out + get(b) if get(b) is not None else out


def _attention(U, spec, get):
    """The attention sublayer of `spec` (heads, biases, causal mask, W_O); get(name): the parameter
    or None."""
    h = spec.heads
    Q, K, V = _linear(U, get, "W_Q", "b_Q"), _linear(U, get, "W_K", "b_K"), _linear(U, get, "W_V", "b_V")
    dk, dv = Q.shape[-1] // h, V.shape[-1] // h
    L = U.shape[-2]
    heads = []
    for i in range(h):
        T = Q[..., i * dk:(i + 1) * dk] @ K[..., i * dk:(i + 1) * dk].transpose(-1, -2) / math.sqrt(dk)
        if spec.causal:
            mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=T.device), diagonal=1)
            T = T.masked_fill(mask, float("-inf"))
        heads.append(softmax_rows(T) @ V[..., i * dv:(i + 1) * dv])
    F = heads[0] if h == 1 else torch.cat(heads, dim=-1)
    return _linear(F, get, "W_O", "b_O") if spec.out_proj else F


def _ffn(U, spec, get):
    return _linear(_ACTIVATIONS[spec.activation](_linear(U, get, "W_1", "b_1")), get, "W_2", "b_2")


def _norm(u, spec, gamma, beta, eps, fused):
    """The spec's norm of the rows of u: RMSNorm (times gamma) or LayerNorm (gamma, beta)."""
    if spec.norm == "rmsnorm":
        z = u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)
        return z * gamma if gamma is not None else z
    return layernorm(u, eps, gamma, beta, fused=fused)


def family_block(X, spec, named, eps=None, *, fused=False):
    """Z of any block of the family, from its definition (the BlockSpec docstring): ``named`` maps
    parameter names (blockhess's registry) to tensors; X is (L, d) or (B, L, d). fused: LayerNorm
    through ``torch.nn.functional.layer_norm`` (see layernorm)."""
    eps = spec.eps if eps is None else eps
    get = named.get

    def norm(u, k):
        return _norm(u, spec, get(f"gamma_{k}"), get(f"beta_{k}"), eps, fused)

    if spec.attention_only:  # the lone self-attention layer: no residual, no norms, no FFN
        return _attention(X, spec, get)
    if spec.norm_position == "post":
        Y = norm(X + _attention(X, spec, get), 1)
        return norm(Y + _ffn(Y, spec, get), 2)
    Y = X + _attention(norm(X, 1), spec, get)
    return Y + _ffn(norm(Y, 2), spec, get)


def stack(X, spec, named, eps=None, *, fused=False):
    """Z of a stack of blocks (a blockhess.ModelSpec; a BlockSpec is one block): each layer's block
    on the previous one's output, with that layer's parameters (named with its prefix, h.<l>.), then
    the final norm (ln_f.gamma, ln_f.beta) if the spec has one. A language model's X is token ids:
    their rows of wte; a ViT's, patches: X W_E + b_E; then wpe's first L rows. With an LM head the
    output is the logits Z wte^T (the one tensor wte used twice, so that autograd sums both uses);
    with a classifier, each token's logits Z W_C + b_C."""
    block = getattr(spec, "block", spec)
    Z = X
    if spec.reads_tokens:
        Z = named["wte"][X]
    elif spec.patch_dim:
        Z = X @ named["W_E"] + named["b_E"]
        if spec.class_token:  # first in every sample
            Z = torch.cat([named["cls_token"].expand(*Z.shape[:-2], 1, Z.shape[-1]), Z], dim=-2)
    if spec.n_positions:
        Z = Z + named["wpe"][: Z.shape[-2]]
    for layer in range(spec.n_layers):
        prefix = spec.layer_prefix(layer)
        own = {n[len(prefix):]: t for n, t in named.items() if n.startswith(prefix)}
        Z = family_block(Z, block, own, eps, fused=fused)
    if getattr(spec, "final_norm", False):
        Z = _norm(Z, block, named.get("ln_f.gamma"), named.get("ln_f.beta"), block.eps if eps is None else eps,
                  fused)
    if spec.lm_head:
        Z = Z @ named["wte"].T
    if spec.classes:
        Z = Z @ named["W_C"] + named["b_C"]
    return Z


def family_of_flat(X, spec, names, shapes, eps=None):
    """Z as a function of the flat vector of every parameter (in blockhess's canonical order), for a
    block or a stack."""
    sizes = [math.prod(s) for s in shapes]

    def output_of(v):
        pieces = v.split(sizes)
        return stack(X, spec, {n: p.reshape(s) for n, p, s in zip(names, pieces, shapes)}, eps)

    return output_of
