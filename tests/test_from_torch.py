"""from_torch: torch.nn.TransformerEncoderLayer and transformers' GPT2Block imported into the
family. The forward equals the module's (float64, 1e-12) and loss_hessian equals autograd's Hessian
of the same loss as a function of the module's own parameters (mapped to blockhess's order)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.attention

import blockhess
import reference as ref

L, B = 5, 2


def _hessian_of_module(call, to_module, params, X, target):
    """torch.func.hessian of mean((module(X) - target)^2) as a function of the flat blockhess vector v,
    with v mapped to the module's parameters by to_module."""
    names, shapes, sizes = params.names, params.shapes, params.sizes

    def loss_of(v):
        pieces = dict(zip(names, (p.reshape(s) for p, s in zip(v.split(list(sizes)), shapes))))
        return ((call(to_module(pieces), ref.t(X)) - ref.t(target)) ** 2).mean()

    # Double backward through autograd, with the math kernel of scaled_dot_product_attention (the
    # fused CPU one has no second derivative). Not torch.func: its second derivatives of
    # nn.TransformerEncoderLayer disagree with finite differences of the layer's own autograd
    # gradient (by 2% here, torch 2.13), while torch.autograd's agree with them and with blockhess.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.autograd.functional.hessian(loss_of, ref.t(params.flatten())).numpy()


def _encoder_to_module(p, d):
    out = {"self_attn.in_proj_weight": torch.cat([p["W_Q"].T, p["W_K"].T, p["W_V"].T]),
           "self_attn.out_proj.weight": p["W_O"].T, "linear1.weight": p["W_1"].T, "linear2.weight": p["W_2"].T,
           "norm1.weight": p["gamma_1"], "norm1.bias": p["beta_1"], "norm2.weight": p["gamma_2"], "norm2.bias": p["beta_2"]}
    if "b_Q" in p:
        out.update({"self_attn.in_proj_bias": torch.cat([p["b_Q"], p["b_K"], p["b_V"]]), "self_attn.out_proj.bias": p["b_O"],
                    "linear1.bias": p["b_1"], "linear2.bias": p["b_2"]})
    return out


@pytest.mark.parametrize("nhead", [1, 2])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer(rng, nhead, norm_first, activation, batch_first):
    torch.manual_seed(int(rng.integers(1 << 30)))
    d = 4
    layer = torch.nn.TransformerEncoderLayer(d, nhead, dim_feedforward=6, dropout=0.0, activation=activation,
                                             batch_first=batch_first, norm_first=norm_first, layer_norm_eps=1e-4,
                                             dtype=torch.float64).eval()
    with torch.no_grad():  # away from the defaults (gamma = 1, beta = 0)
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    spec, params = blockhess.from_torch(layer)
    assert spec.norm_position == ("pre" if norm_first else "post") and spec.heads == nhead and spec.activation == activation
    X = rng.standard_normal((B, L, d))
    target = rng.standard_normal((B, L, d))

    def call(module_params, x):
        layer.train()  # dropout is 0; eval mode would take torch's fused fast path
        x = x if batch_first else x.transpose(0, 1)
        out = torch.func.functional_call(layer, module_params, (x,))
        return out if batch_first else out.transpose(0, 1)

    with torch.no_grad():
        Z_module = call(dict(layer.named_parameters()), ref.t(X)).numpy()
    assert ref.rel_err(blockhess.block_forward(X, params), Z_module) <= 1e-12
    H = blockhess.loss_hessian(X, target, params)
    assert ref.rel_err(H, _hessian_of_module(call, lambda p: _encoder_to_module(p, d), params, X, target)) <= 1e-10


def test_encoder_layer_refusals_and_warnings():
    layer = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"training mode with dropout \(p = 0.1\).*module.eval\(\)"):
        blockhess.from_torch(layer.train())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blockhess.from_torch(layer.eval())
    with pytest.raises(ValueError, match="activation"):
        blockhess.from_torch(torch.nn.TransformerEncoderLayer(4, 2, activation=torch.tanh, dtype=torch.float64).eval())
    with pytest.raises(ValueError, match="without bias"):
        blockhess.from_torch(torch.nn.TransformerEncoderLayer(4, 2, bias=False, dtype=torch.float64).eval())
    with pytest.raises(TypeError, match="TransformerEncoderLayer, a torch.nn.TransformerEncoder or a transformers GPT2Block, GPT2Model"):
        blockhess.from_torch(torch.nn.Linear(3, 3))


def test_gpt2_block(rng):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(int(rng.integers(1 << 30)))
    config = transformers.GPT2Config(n_embd=6, n_head=2, n_layer=1, n_positions=16, n_inner=8,
                                     attn_implementation="eager")
    block = GPT2Block(config).eval().double()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    spec, params = blockhess.from_torch(block)
    assert (spec.norm_position, spec.causal, spec.activation, spec.heads) == ("pre", True, "gelu_tanh", 2)
    X = rng.standard_normal((B, L, 6))
    target = rng.standard_normal((B, L, 6))
    # GPT-2 builds the causal mask in the model and hands it to each block: an additive (B, 1, L, L) mask.
    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(B, 1, L, L)

    def call(module_params, x):
        out = torch.func.functional_call(block, module_params, (x,), {"attention_mask": mask})
        return out[0] if isinstance(out, tuple) else out

    def to_module(p):
        return {"attn.c_attn.weight": torch.cat([p["W_Q"], p["W_K"], p["W_V"]], 1),
                "attn.c_attn.bias": torch.cat([p["b_Q"], p["b_K"], p["b_V"]]),
                "attn.c_proj.weight": p["W_O"], "attn.c_proj.bias": p["b_O"],
                "ln_1.weight": p["gamma_1"], "ln_1.bias": p["beta_1"], "ln_2.weight": p["gamma_2"], "ln_2.bias": p["beta_2"],
                "mlp.c_fc.weight": p["W_1"], "mlp.c_fc.bias": p["b_1"], "mlp.c_proj.weight": p["W_2"], "mlp.c_proj.bias": p["b_2"]}

    with torch.no_grad():
        Z_module = call(dict(block.named_parameters()), ref.t(X)).numpy()
    assert ref.rel_err(blockhess.block_forward(X, params), Z_module) <= 1e-12
    H = blockhess.loss_hessian(X, target, params)
    assert ref.rel_err(H, _hessian_of_module(call, to_module, params, X, target)) <= 1e-10


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("final_norm", [False, True])
def test_a_transformer_encoder_is_a_model_spec(norm_first, final_norm):
    """nn.TransformerEncoder: its layers as a stack (h.<l>.*), its norm as the final norm (ln_f.*);
    every parameter once (params.size = the module's), and the forward, loss and gradient of the
    imported stack against the module's own through torch autograd."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, activation="gelu",
                                             norm_first=norm_first, batch_first=True, dtype=torch.float64)
    norm = torch.nn.LayerNorm(8, dtype=torch.float64) if final_norm else None
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, norm=norm, enable_nested_tensor=False).eval()
    spec, params = blockhess.from_torch(encoder)
    assert isinstance(spec, blockhess.ModelSpec) and spec.n_layers == 2 and spec.final_norm == final_norm
    assert params.size == sum(p.numel() for p in encoder.parameters())
    assert params.names[0] == "h.0.W_Q" and (params.names[-1] == "ln_f.beta") == final_norm
    X = torch.randn(2, 5, 8, dtype=torch.float64)
    target = torch.randn(2, 5, 8, dtype=torch.float64)
    encoder.train()  # the differentiable forward (its fused inference path is not); no dropout
    names = [n for n, _ in encoder.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in encoder.parameters()])
    shapes = [p.shape for p in encoder.parameters()]

    def module_loss(v):
        tensors = dict(zip(names, (t.reshape(s) for t, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        return ((torch.func.functional_call(encoder, tensors, (X,)) - target) ** 2).mean()

    eps = layer.norm1.eps
    module_Z = torch.func.functional_call(encoder, dict(zip(names, encoder.parameters())), (X,)).detach().numpy()
    assert np.allclose(blockhess.block_forward(X, params, eps=eps).numpy(), module_Z, rtol=0, atol=1e-12)
    value = blockhess.loss_value(X, target, params, eps=eps)
    assert abs(value - float(module_loss(flat))) <= 1e-13 * abs(value)
    # The module's gradient, laid out as blockhess's by the importer's own reader (a linear map:
    # slices and transposes), against blockhess's gradient of the imported stack.
    from blockhess.from_torch import _encoder

    holder = copy.deepcopy(encoder)
    with torch.no_grad():
        for p, g in zip(holder.parameters(), torch.func.grad(module_loss)(flat).split([s.numel() for s in shapes])):
            p.copy_(g.reshape(p.shape))
    _, arrays, _ = _encoder(holder, torch.float64)
    module_grad = blockhess.BlockParams.from_arrays(spec, arrays).flatten()
    ours = blockhess.loss_gradient(X, target, params, eps=eps).numpy()
    assert np.linalg.norm(ours - module_grad) <= 1e-12 * np.linalg.norm(module_grad)

    # Hessian-vector products and the top layer's dense Hessian (and the final norm's), against the
    # module's own reverse-over-reverse autograd (math attention: the fused kernel has no second
    # derivative), laid out by the same reader.
    def laid_out(module_vector):
        with torch.no_grad():
            for p, g in zip(holder.parameters(), module_vector.split([s.numel() for s in shapes])):
                p.copy_(g.reshape(p.shape))
        return blockhess.BlockParams.from_arrays(spec, _encoder(holder, torch.float64)[1]).flatten()

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        u = torch.randn(flat.shape, dtype=torch.float64)
        x = flat.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(module_loss(x), x, create_graph=True)
        (hu,) = torch.autograd.grad(g, x, grad_outputs=u)
        module_H = torch.autograd.functional.hessian(module_loss, flat).numpy()
    ours_hu = blockhess.loss_hvp(X, target, params, laid_out(u), eps=eps)
    assert ref.rel_err(np.asarray(ours_hu), laid_out(hu)) <= 1e-10
    top = tuple(n for n in params.names if n.startswith(("h.1.", "ln_f.")))
    # the module's Hessian in blockhess's layout: a permutation P, laid_out(e_k) its columns
    P = np.stack([laid_out(e) for e in torch.eye(flat.numel(), dtype=torch.float64)], axis=1)
    ours_H = P @ module_H @ P.T
    chosen = np.concatenate([np.arange(params.slices()[n].start, params.slices()[n].stop) for n in top])
    H = np.asarray(blockhess.loss_hessian(X, target, params, eps=eps, wrt=top))
    assert ref.rel_err(H, ours_H[np.ix_(chosen, chosen)]) <= 1e-10 and np.array_equal(H, H.T)


def test_an_encoder_the_stack_cannot_represent_is_refused():
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True,
                                             dtype=torch.float64)
    mixed = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    mixed.layers[1] = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, activation="gelu",
                                                       batch_first=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="layers 0 and 1 of the TransformerEncoder differ"):
        blockhess.from_torch(mixed)
    rms = torch.nn.TransformerEncoder(layer, num_layers=2, norm=torch.nn.RMSNorm(8, dtype=torch.float64),
                                      enable_nested_tensor=False).eval()
    with pytest.raises(ValueError, match="a LayerNorm and a RMSNorm"):
        blockhess.from_torch(rms)


def _tiny_gpt2(lm: bool, **config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**dict(vocab_size=19, n_positions=12, n_embd=8, n_layer=2, n_head=2, n_inner=10,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               attn_implementation="eager", bos_token_id=0, eos_token_id=0), **config})
    model = (transformers.GPT2LMHeadModel if lm else transformers.GPT2Model)(config).double().eval()
    with torch.no_grad():  # away from the initialisation's tiny weights, so that every path counts
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def test_a_gpt2_language_model_is_a_model_spec_with_its_loss_gradient_and_hvp():
    """GPT2LMHeadModel: wte, wpe, its blocks (h.<l>.*), ln_f and the LM head tied to wte; every
    parameter once (params.size = the module's). The loss is Hugging Face's own (to float32
    rounding: it casts the logits to float32) and, in float64, the same definition; the gradient and
    Hessian-vector products equal the module's own through torch autograd (reverse over reverse,
    which is right for torch's layer_norm), laid out as blockhess's by the importer's reader."""
    from blockhess._torch_reference import loss as reference_loss
    from blockhess.from_torch import _gpt2_model

    model = _tiny_gpt2(lm=True)
    spec, params = blockhess.from_torch(model)
    assert isinstance(spec, blockhess.ModelSpec) and (spec.n_layers, spec.vocab_size, spec.n_positions) == (2, 19, 12)
    assert spec.lm_head and spec.final_norm and spec.block.causal and spec.block.activation == "gelu_tanh"
    assert params.size == sum(p.numel() for p in model.parameters())  # the tied weight once
    assert params.names[:3] == ("wte", "wpe", "h.0.W_Q") and params.names[-1] == "ln_f.beta"
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 19, size=(2, 6))
    labels = ids.copy()
    labels[0, 2] = -100
    eps = model.transformer.ln_f.eps
    logits = model(input_ids=torch.as_tensor(ids)).logits.detach().numpy()
    assert ref.rel_err(blockhess.block_forward(ids, params, eps=eps), logits) <= 1e-12
    value = blockhess.loss_value(ids, labels, params, loss="next_token", eps=eps)
    hf_loss = float(model(input_ids=torch.as_tensor(ids), labels=torch.as_tensor(labels)).loss.detach())
    assert abs(value - hf_loss) <= 1e-6 * abs(value)  # Hugging Face's loss is float32 (its cast)

    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def module_loss(v):
        tensors = dict(zip(names, (t.reshape(s) for t, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        out = torch.func.functional_call(model, tensors, (), {"input_ids": torch.as_tensor(ids), "use_cache": False})
        return reference_loss(out.logits, torch.as_tensor(labels), "next_token")

    assert abs(value - float(module_loss(flat))) <= 1e-13 * abs(value)

    def laid_out(module_vector):
        """A vector over the module's parameters in blockhess's layout (the importer's reader)."""
        holder = copy.deepcopy(model)
        with torch.no_grad():
            for p, g in zip(holder.parameters(), module_vector.split([s.numel() for s in shapes])):
                p.copy_(g.reshape(p.shape))
        return blockhess.BlockParams.from_arrays(spec, _gpt2_model(holder, torch.float64)[1]).flatten()

    x = flat.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(module_loss(x), x, create_graph=True)
    assert ref.rel_err(blockhess.loss_gradient(ids, labels, params, loss="next_token", eps=eps), laid_out(g.detach())) <= 1e-12
    u = torch.randn(flat.shape, dtype=torch.float64)
    (hu,) = torch.autograd.grad(g, x, grad_outputs=u)
    ours = blockhess.loss_hvp(ids, labels, params, laid_out(u), loss="next_token", eps=eps)
    assert ref.rel_err(ours, laid_out(hu)) <= 1e-10


def test_a_gpt2_model_is_its_last_hidden_state():
    model = _tiny_gpt2(lm=False)
    spec, params = blockhess.from_torch(model)
    assert not spec.lm_head and spec.vocab_size == 19 and params.size == sum(p.numel() for p in model.parameters())
    ids = np.random.default_rng(2).integers(0, 19, size=(3, 7))
    hidden = model(input_ids=torch.as_tensor(ids)).last_hidden_state.detach().numpy()
    assert ref.rel_err(blockhess.block_forward(ids, params, eps=model.ln_f.eps), hidden) <= 1e-12
    # a float32 model (transformers' default) is imported in float32, and verified in float64
    spec32, params32 = blockhess.from_torch(model.float())
    assert spec32 == spec and params32.dtype == np.float32


def test_a_gpt2_model_the_import_cannot_represent_is_refused():
    with pytest.raises(ValueError, match="not tied to transformer.wte"):
        blockhess.from_torch(_tiny_gpt2(lm=True, tie_word_embeddings=False))
    model = _tiny_gpt2(lm=False)
    model.h[1].mlp.act = torch.nn.ReLU()
    with pytest.raises(ValueError, match="blocks h.0 and h.1 of the GPT2Model differ"):
        blockhess.from_torch(model)
    dropping = _tiny_gpt2(lm=False, embd_pdrop=0.1).train()
    with pytest.raises(ValueError, match="training mode with dropout"):
        blockhess.from_torch(dropping)


def _tiny_vit(classifier: bool, **config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**dict(image_size=8, patch_size=4, num_channels=2, hidden_size=8,
                                              num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
                                              num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                              attn_implementation="eager"), **config})
    vit = transformers.ViTForImageClassification if classifier else transformers.ViTModel
    model = (vit(config) if classifier else vit(config, add_pooling_layer=False)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def test_a_hugging_face_vit_is_a_model_spec_with_its_loss_gradient_and_hvp():
    """ViTForImageClassification: its Conv2d patch embedding as W_E of blockhess.image_patches, the
    class token, the positions, its layers, the final layernorm and the classifier on the class
    token; every parameter once. The loss (cross-entropy of the class token's logits) and its
    gradient and Hessian-vector products equal the module's own reverse-over-reverse autograd, laid
    out by the importer's reader. The module runs through sdpa's math kernel: its eager attention
    takes the softmax in float32 whatever the dtype."""
    from blockhess.from_torch import _run_vit, _vit

    model = _tiny_vit(classifier=True)
    spec, params = blockhess.from_torch(model)
    assert spec.class_token and spec.classes == 3 and spec.patch_dim == 32 and spec.n_positions == 5
    assert params.size == sum(p.numel() for p in model.parameters())
    assert params.names[:4] == ("W_E", "b_E", "cls_token", "wpe") and params.names[-2:] == ("W_C", "b_C")
    images = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1])
    patches = blockhess.image_patches(images, 4)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def module_loss(v):
        tensors = dict(zip(names, (t.reshape(s) for t, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        logits = _run_vit(lambda *a, **k: torch.func.functional_call(model, tensors, a, k), model,
                          torch.as_tensor(patches))
        return torch.nn.functional.cross_entropy(logits, labels)

    holder = copy.deepcopy(model)

    def laid_out(module_vector):
        with torch.no_grad():
            for p, g in zip(holder.parameters(), module_vector.split([s.numel() for s in shapes])):
                p.copy_(g.reshape(p.shape))
        return blockhess.BlockParams.from_arrays(spec, _vit(holder, torch.float64)[1]).flatten()

    value = blockhess.loss_value(patches, labels, params, loss="pooled_cross_entropy")
    assert abs(value - float(module_loss(flat))) <= 1e-13 * abs(value)
    x = flat.clone().requires_grad_(True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        (g,) = torch.autograd.grad(module_loss(x), x, create_graph=True)
        u = torch.randn(flat.shape, dtype=torch.float64)
        (hu,) = torch.autograd.grad(g, x, grad_outputs=u)
    ours_g = blockhess.loss_gradient(patches, labels, params, loss="pooled_cross_entropy")
    assert ref.rel_err(np.asarray(ours_g), laid_out(g.detach())) <= 1e-12
    ours_hu = blockhess.loss_hvp(patches, labels, params, laid_out(u), loss="pooled_cross_entropy")
    assert ref.rel_err(np.asarray(ours_hu), laid_out(hu)) <= 1e-10
    # a ViTModel (no pooler) is its last hidden state, every token's
    body = _tiny_vit(classifier=False)
    spec_body, params_body = blockhess.from_torch(body)
    assert not spec_body.classes and params_body.size == sum(p.numel() for p in body.parameters())
    hidden = _run_vit(lambda *a, **k: body(*a, **k), body, torch.as_tensor(patches)).detach().numpy()
    assert ref.rel_err(np.asarray(blockhess.block_forward(patches, params_body)), hidden) <= 1e-12


def test_a_vit_the_import_cannot_represent_is_refused():
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="has a pooler"):
        blockhess.from_torch(transformers.ViTModel(transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=8,
                                                                          num_hidden_layers=1, num_attention_heads=2,
                                                                          intermediate_size=8)))
    with pytest.raises(ValueError, match="has a bias on every linear map or on none"):
        blockhess.from_torch(_tiny_vit(classifier=True, qkv_bias=False))
    with pytest.raises(ValueError, match="split into 3 x 3 patches"):
        blockhess.image_patches(np.zeros((1, 2, 8, 8)), 3)
