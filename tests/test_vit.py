"""A ViT (blockhess.ModelSpec with patch_dim, n_positions and classes) on the engine: the patch
embedding X W_E + b_E (a linear node), learned positions wpe (engine/nodes/positions.hpp), the
blocks, a final norm, and a classifier W_C, b_C of the model's own writing each token's logits,
which loss="pooled_cross_entropy" averages per sample (the logits of the mean token:
engine/heads/pooled_cross_entropy.hpp with the identity).

Every function must equal torch autograd of the same model written from its definition (the torch
reference's stack), float64, relative error <= 1e-10; the dense Hessian over the last block, the
final norm and the classifier too. The ViT that blockhess.experiments trains is checked whole
against its own torch definition (experiments/vit.py's loss).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as ref
import blockhess
from blockhess import BlockParams, BlockSpec, ModelSpec
from blockhess._torch_reference import loss as reference_loss
from blockhess._torch_reference import stack

EPS = 1e-5
BLOCK = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                  eps=EPS)


def _vit(rng, layers=2, final_norm=True, L=5, B=3):
    spec = ModelSpec(BLOCK, n_layers=layers, final_norm=final_norm, patch_dim=4, n_positions=L + 1, classes=3)
    params = BlockParams.random(spec, d=6, d_k=3, d_ff=7, seed=int(rng.integers(1 << 30)))
    X, labels = rng.standard_normal((B, L, 4)), rng.integers(0, 3, size=B)
    return spec, params, X, labels


def _scalar(spec, params, X, target, loss):
    def scalar(v):
        named = {n: v[sl].reshape(shape) for (n, sl), shape in zip(params.slices().items(), params.shapes)}
        return reference_loss(stack(torch.as_tensor(X), spec, named, EPS), torch.as_tensor(target), loss)
    return scalar


def test_a_vits_parameters_and_output():
    spec, params, X, _ = _vit(np.random.default_rng(0))
    assert params.names[:3] == ("W_E", "b_E", "wpe") and params.names[-2:] == ("W_C", "b_C")
    assert params["W_E"].shape == (4, 6) and params["wpe"].shape == (6, 6) and params["W_C"].shape == (6, 3)
    assert blockhess.block_forward(X, params).shape == (3, 5, 3)  # each token's logits


@pytest.mark.parametrize("layers,final_norm", [(1, False), (2, True)])
@pytest.mark.parametrize("loss", ["pooled_cross_entropy", "cross_entropy", "mse"])
def test_loss_gradient_and_hvp_match_autograd(rng, layers, final_norm, loss):
    spec, params, X, labels = _vit(rng, layers, final_norm)
    target = {"pooled_cross_entropy": labels, "cross_entropy": rng.integers(0, 3, size=(3, 5)),
              "mse": rng.standard_normal((3, 5, 3))}[loss]
    scalar, flat = _scalar(spec, params, X, target, loss), ref.t(params.flatten())
    assert ref.rel_err(np.asarray(blockhess.loss_value(X, target, params, loss=loss)), scalar(flat).numpy()) <= 1e-13
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss), torch.func.grad(scalar)(flat).numpy()) <= 1e-11
    V = rng.standard_normal((params.size, 2))
    ref_HV = np.stack([torch.func.jvp(torch.func.grad(scalar), (flat,), (ref.t(c),))[1].numpy() for c in V.T], axis=1)
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, V, loss=loss), ref_HV) <= 1e-10
    op = blockhess.hessian_operator(X, target, params, loss=loss)
    assert ref.rel_err(op @ V[:, 0], ref_HV[:, 0]) <= 1e-10


@pytest.mark.parametrize("loss", ["pooled_cross_entropy", "mse"])
def test_the_top_layers_and_classifiers_dense_hessian_matches_autograd(rng, loss):
    spec, params, X, labels = _vit(rng)
    target = labels if loss == "pooled_cross_entropy" else rng.standard_normal((3, 5, 3))
    scalar, flat = _scalar(spec, params, X, target, loss), ref.t(params.flatten())
    top = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")) or n in ("W_C", "b_C"))
    chosen = np.concatenate([np.arange(params.slices()[n].start, params.slices()[n].stop) for n in top])
    ref_H = torch.func.hessian(scalar)(flat).numpy()[np.ix_(chosen, chosen)]
    H = blockhess.loss_hessian(X, target, params, loss=loss, wrt=top)
    assert ref.rel_err(H, ref_H) <= 1e-10 and np.array_equal(H, H.T)
    parts = [blockhess.loss_hessian(X, target, params, loss=loss, wrt=top, part=p) for p in ("outer", "functional")]
    assert ref.rel_err(parts[0] + parts[1], H) <= 1e-12
    assert ref.rel_err(blockhess.hessian_operator(X, target, params, loss=loss, wrt=top).diagonal(), np.diag(ref_H)) <= 1e-10


def test_the_experiments_vit_is_one_model_with_every_parameter():
    """experiments/vit.py's ViT, exported whole: its loss, gradient and Hessian-vector products with
    respect to every parameter (embedding, positions, block, classifier) equal autograd of its own
    torch definition (vit.loss)."""
    from blockhess.experiments import digits, vit

    model = vit.init_vit(seed=3)
    data = digits.load_digits(seed=0)
    patches, labels = data.train_x[:8], data.train_y[:8]
    spec, params = vit.export_model(model)
    assert params.size == sum(t.numel() for t in model.values())
    names = list(model)
    flat = torch.cat([model[n].detach().reshape(-1) for n in names])
    shapes = [model[n].shape for n in names]

    def torch_loss(v):
        pieces = dict(zip(names, (p.reshape(s) for p, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        return vit.loss(pieces, patches, labels)

    def laid_out(v):  # torch's dict order to blockhess's (P is wpe)
        pieces = dict(zip(names, (p.reshape(s).numpy() for p, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        return BlockParams.from_arrays(spec, {("wpe" if n == "P" else n): a for n, a in pieces.items()}).flatten()

    value = blockhess.loss_value(patches, labels, params, loss="pooled_cross_entropy")
    assert abs(value - float(torch_loss(flat))) <= 1e-13 * abs(value)
    grad = blockhess.loss_gradient(patches, labels, params, loss="pooled_cross_entropy")
    assert ref.rel_err(grad, laid_out(torch.func.grad(torch_loss)(flat))) <= 1e-12
    u = torch.as_tensor(np.random.default_rng(1).standard_normal(flat.numel()))
    hu = torch.func.jvp(torch.func.grad(torch_loss), (flat,), (u,))[1]
    assert ref.rel_err(blockhess.loss_hvp(patches, labels, params, laid_out(u), loss="pooled_cross_entropy"),
                       laid_out(hu)) <= 1e-10


def test_bad_vit_input_is_refused_clearly(rng):
    spec, params, X, labels = _vit(rng)
    with pytest.raises(ValueError, match="this model has its own classifier"):
        blockhess.loss_value(X, labels, params, loss="pooled_cross_entropy", head=(np.ones((6, 3)), np.zeros(3)))
    with pytest.raises(ValueError, match="patch_dim = 4"):
        blockhess.block_forward(rng.standard_normal((3, 5, 6)), params)
    with pytest.raises(ValueError, match="n_positions = 6"):
        blockhess.block_forward(rng.standard_normal((3, 7, 4)), params)
    with pytest.raises(ValueError, match=r"class index 3 is out of range: classes must lie in \[0, 3\)"):
        blockhess.loss_value(X, np.array([0, 1, 3]), params, loss="pooled_cross_entropy")
    with pytest.raises(ValueError, match="token ids .* or patches"):
        ModelSpec(BLOCK, vocab_size=5, patch_dim=4)
    with pytest.raises(ValueError, match="an lm_head or a classifier"):
        ModelSpec(BLOCK, vocab_size=5, lm_head=True, classes=3)


@pytest.mark.parametrize("loss", ["pooled_cross_entropy", "cross_entropy"])
def test_a_class_token_vit_matches_autograd(rng, loss):
    """With class_token (Hugging Face's ViT) every sample's first token is cls_token, before its L
    patches: L + 1 tokens, and pooled_cross_entropy classifies the first token's logits."""
    spec = ModelSpec(BLOCK, n_layers=2, final_norm=True, patch_dim=4, n_positions=6, classes=3, class_token=True)
    params = BlockParams.random(spec, d=6, d_k=3, d_ff=7, seed=int(rng.integers(1 << 30)))
    assert params.names[:4] == ("W_E", "b_E", "cls_token", "wpe")
    X = rng.standard_normal((3, 5, 4))
    target = rng.integers(0, 3, size=3) if loss == "pooled_cross_entropy" else rng.integers(0, 3, size=(3, 6))
    assert blockhess.block_forward(X, params).shape == (3, 6, 3) and blockhess.block_forward(X[0], params).shape == (6, 3)
    reference = (lambda Z, t, kind: torch.nn.functional.cross_entropy(Z[..., 0, :], t)) if loss == "pooled_cross_entropy" \
        else reference_loss

    def scalar(v):
        named = {n: v[sl].reshape(shape) for (n, sl), shape in zip(params.slices().items(), params.shapes)}
        return reference(stack(torch.as_tensor(X), spec, named, EPS), torch.as_tensor(target), loss)

    flat = ref.t(params.flatten())
    assert ref.rel_err(np.asarray(blockhess.loss_value(X, target, params, loss=loss)), scalar(flat).numpy()) <= 1e-13
    assert ref.rel_err(blockhess.loss_gradient(X, target, params, loss=loss), torch.func.grad(scalar)(flat).numpy()) <= 1e-11
    v = rng.standard_normal(params.size)
    ref_hv = torch.func.jvp(torch.func.grad(scalar), (flat,), (ref.t(v),))[1].numpy()
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, v, loss=loss), ref_hv) <= 1e-10
    top = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")) or n in ("W_C", "b_C"))
    chosen = np.concatenate([np.arange(params.slices()[n].start, params.slices()[n].stop) for n in top])
    ref_H = torch.func.hessian(scalar)(flat).numpy()[np.ix_(chosen, chosen)]
    H = blockhess.loss_hessian(X, target, params, loss=loss, wrt=top)
    assert ref.rel_err(H, ref_H) <= 1e-10 and np.array_equal(H, H.T)
    with pytest.raises(ValueError, match="5 tokens per sample and a class token, but wpe has only n_positions = 5"):
        blockhess.block_forward(X, BlockParams.random(ModelSpec(BLOCK, patch_dim=4, n_positions=5, class_token=True),
                                                      d=6, d_k=3, d_ff=7))
    with pytest.raises(ValueError, match="class_token needs a patch embedding"):
        ModelSpec(BLOCK, class_token=True)
