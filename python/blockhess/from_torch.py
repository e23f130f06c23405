"""Import a block from PyTorch: ``spec, params = blockhess.from_torch(module)``.

Supported: ``torch.nn.TransformerEncoderLayer`` (any ``nhead``, ``norm_first`` either way,
``batch_first`` either way), ``torch.nn.TransformerEncoder`` (its layers, all of one configuration, and
its final ``norm`` if it has one: a :class:`blockhess.ModelSpec`) and Hugging Face ``transformers``'
``GPT2Block`` (pre-LN, causal,
Conv1D weights; eager or sdpa attention), with ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` norms
and the activations relu, gelu (erf), gelu (tanh) or silu, functions or modules.

The import reads what runs (the submodules the forward calls and their own attributes, never
cached flags or the config they were built from), refuses what the family cannot represent with a
ValueError or TypeError that names it, and then runs the module on a random input (float64 copies of
its parameters, grad enabled so that torch's fused inference paths do not stand in for the forward)
and compares with :func:`blockhess.block_forward`: a module that computes something else, e.g. a
subclass, a patched forward or a forward hook, is a ValueError, never a silently different block.
The caller's module is left as it was (its parameters, dtype, training flags and gradients).

The parameters are copied (float64 or float32, as the module holds them) into blockhess's canonical
order. Layouts: torch's ``nn.Linear`` computes ``x W^T + b`` (weights stored (out, in)), blockhess
``x W + b`` (W stored (in, out)); ``Conv1D`` of GPT-2 already stores (in, out).
``TransformerEncoderLayer`` with ``batch_first=False`` takes (L, B, d); blockhess takes (B, L, d) (or
(L, d) for one sample).

Language models: ``transformers``' ``GPT2Model`` (wte, wpe, its GPT2Blocks, ln_f: a
:class:`blockhess.ModelSpec` whose output is the last hidden state) and ``GPT2LMHeadModel`` (the same
with its LM head tied to wte: the output is the logits, and ``loss="next_token"`` is the model's own
loss for ``labels``). X is then the token ids, (L,) or (B, L); ``params.size`` equals the module's
parameter count (the tied weight once). The import runs the model without an attention mask: a
padding mask, token_type_ids, a KV cache and cross-attention are not represented.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from .block import BlockParams, block_forward
from .model import ModelSpec
from .spec import BlockSpec

# The float64 rerun and blockhess's forward differ by rounding only (about 1e-15 relative); a
# different activation, a missing bias or a hook differs by far more (gelu against its tanh form,
# the closest pair: about 4e-5 on a random layer).
_VERIFY_RTOL = 1e-9
_VERIFY_SHAPE = (2, 5)  # (B, L) of the random input


def from_torch(module: Any) -> tuple[BlockSpec | ModelSpec, BlockParams]:
    """(spec, params) of a ``torch.nn.TransformerEncoderLayer``, a ``torch.nn.TransformerEncoder`` (a
    ModelSpec), a ``transformers`` ``GPT2Block``, or a ``GPT2Model`` or ``GPT2LMHeadModel`` (a language
    model's ModelSpec), verified against the module's own forward before they are returned."""
    read, run = _importer(module)
    dtype = _parameter_dtype(module)
    spec, arrays, norms = read(module, dtype)
    params = BlockParams.from_arrays(spec, {k: np.ascontiguousarray(v) for k, v in arrays.items()})
    _verify(module, run, params, norms)
    return spec, params


def _importer(module: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(read, run) for the module's class: read(module, dtype) -> (spec, arrays, norms), the
    parameters in blockhess's names; run(call, module, X) -> its output, through call (the module's
    forward, e.g. a functional_call), for X in blockhess's layout (token ids for a language model)."""
    import torch

    gpt2 = sys.modules.get("transformers.models.gpt2.modeling_gpt2")  # imported if module is GPT-2's
    vit = sys.modules.get("transformers.models.vit.modeling_vit")  # imported if module is a ViT
    if isinstance(module, torch.nn.TransformerEncoderLayer):
        return _encoder_layer, _run_encoder_layer
    if isinstance(module, torch.nn.TransformerEncoder):
        return _encoder, _run_encoder
    if gpt2 is not None and isinstance(module, gpt2.GPT2Block):
        return _gpt2_block, _run_gpt2_block
    if gpt2 is not None and isinstance(module, (gpt2.GPT2Model, gpt2.GPT2LMHeadModel)):
        return _gpt2_model, _run_gpt2_model
    if vit is not None and isinstance(module, (vit.ViTModel, vit.ViTForImageClassification)):
        return _vit, _run_vit
    raise TypeError(f"from_torch takes a torch.nn.TransformerEncoderLayer, a torch.nn.TransformerEncoder or a "
                    f"transformers GPT2Block, GPT2Model, GPT2LMHeadModel, ViTModel or ViTForImageClassification, "
                    f"got {type(module).__name__}")


def _parameter_dtype(module: Any) -> Any:
    """The one dtype of the module's parameters, float32 or float64, with values on a real device."""
    import torch

    parameters = list(module.parameters())
    if any(p.device.type == "meta" for p in parameters):
        raise ValueError("from_torch: the module's parameters are on the meta device and have no values; "
                         "materialise them first (module.to_empty(device=...) and load_state_dict)")
    dtypes = {p.dtype for p in parameters}
    if len(dtypes) != 1:
        raise TypeError(f"from_torch: the module's parameters mix dtypes {sorted(map(str, dtypes))}; "
                        "they must all be torch.float32 or all torch.float64")
    dtype = dtypes.pop()
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"from_torch: the module's parameters are {dtype}; blockhess computes in float32 or "
                        "float64, and a module in lower precision rounds every step differently: import a "
                        "copy converted with copy.deepcopy(module).float() if that is what you want")
    return dtype


def _array(t: Any) -> np.ndarray:
    return np.array(t.detach().cpu().numpy())  # a copy: blockhess never shares memory with the module


def _require_types(module: Any, expected: dict[str, Any]) -> None:
    """Each submodule that runs (a dotted path; "" is the module) is exactly of its class: a subclass
    may override forward, and then the import of its class would describe something else."""
    for path, cls in expected.items():
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            raise TypeError(f"from_torch: the {type(module).__name__} has no submodule {path}") from None
        if type(sub) is not cls:
            what = path or "the module"
            raise TypeError(f"from_torch: {what} is a {type(sub).__qualname__}, not a {cls.__qualname__}: only "
                            "that class itself is imported (a subclass may compute something else)")


def _activation(act: Any, where: str) -> str:
    """The family's name of the activation that runs: a torch function, or a module of exactly one of
    torch's or transformers' activation classes."""
    import torch

    F = torch.nn.functional
    for function, name in ((F.relu, "relu"), (torch.relu, "relu"), (F.gelu, "gelu"), (F.silu, "silu")):
        if act is function:
            return name
    classes = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}
    hf = sys.modules.get("transformers.activations")
    if hf is not None:
        classes.update({hf.GELUActivation: "gelu", hf.NewGELUActivation: "gelu_tanh", hf.GELUTanh: "gelu_tanh",
                        hf.SiLUActivation: "silu"})
    kind = type(act)
    if kind is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]  # torch accepts only these two
    if kind in classes:
        return classes[kind]
    if isinstance(act, (torch.nn.GELU, *classes)):
        raise TypeError(f"from_torch: {where} is a {kind.__qualname__}, a subclass of an activation class: only "
                        "those classes themselves are imported (a subclass may compute something else)")
    raise ValueError(f"from_torch: {where} is {act!r}, not an activation of the family (relu, gelu, gelu with "
                     "the tanh approximation, silu)")


def _norms(norms: dict[str, Any], d: int) -> tuple[str, bool]:
    """(BlockSpec.norm, BlockSpec.norm_affine) of the block's two norms, which must agree."""
    import torch

    kinds = {torch.nn.LayerNorm: "layernorm", torch.nn.RMSNorm: "rmsnorm"}
    affine = {}
    for name, norm in norms.items():
        if type(norm) not in kinds:
            raise TypeError(f"from_torch: {name} is a {type(norm).__qualname__}; the family's norms are "
                            "torch.nn.LayerNorm or torch.nn.RMSNorm (exactly those classes)")
        if tuple(norm.normalized_shape) != (d,):
            raise ValueError(f"from_torch: {name} normalises over the trailing shape {tuple(norm.normalized_shape)}; "
                             f"the family's norms normalise each token's d = {d} features")
        affine[name] = norm.weight is not None
        if kinds[type(norm)] == "layernorm" and affine[name] != (norm.bias is not None):
            has, lacks = ("gamma", "bias (beta)") if affine[name] else ("bias (beta)", "gamma")
            raise ValueError(f"from_torch: {name} is a LayerNorm with {has} but without {lacks}; the family's "
                             "affine LayerNorm has both gamma and beta")
    first, second = norms.values()
    names = " and ".join(norms)
    if type(first) is not type(second):
        raise ValueError(f"from_torch: {names} are a {type(first).__name__} and a {type(second).__name__}; the "
                         "family's two norms are of one kind")
    if first.eps != second.eps:
        raise ValueError(f"from_torch: {names} must share one eps, got {first.eps} and {second.eps}")
    if len(set(affine.values())) != 1:
        raise ValueError(f"from_torch: of {names}, only {[n for n, a in affine.items() if a][0]} has a gamma; "
                         "the family's norms are all affine or all plain")
    return kinds[type(first)], first.weight is not None


def _norm_eps(norms: dict[str, Any], dtype: Any) -> float:
    """The eps the norms use on inputs of ``dtype``: nn.RMSNorm's eps=None is torch.finfo(dtype).eps."""
    import torch

    eps = next(iter(norms.values())).eps
    return float(torch.finfo(dtype).eps if eps is None else eps)


def _norm_arrays(norms: dict[str, Any]) -> dict[str, np.ndarray]:
    arrays = {}
    for k, norm in enumerate(norms.values(), start=1):
        if norm.weight is not None:
            arrays[f"gamma_{k}"] = _array(norm.weight)
        if getattr(norm, "bias", None) is not None:
            arrays[f"beta_{k}"] = _array(norm.bias)
    return arrays


def _final_norm_arrays(norm: Any) -> dict[str, np.ndarray]:
    """A model's final norm's parameters under their names, ln_f.gamma (and ln_f.beta)."""
    return {"ln_f." + name.split("_")[0]: a for name, a in _norm_arrays({"ln_f": norm}).items()}


def _read_layers(layers: list[Any], read: Callable[..., Any], dtype: Any, what: str, kind: str = "layers",
                 prefix: str = "") -> tuple[BlockSpec, dict[str, Any], list[dict[str, np.ndarray]]]:
    """Each of a model's layers by ``read`` (a block's reader), all of one spec (a ModelSpec stacks
    blocks of one spec): (that spec, the first layer's norms, each layer's arrays). ``what``,
    ``kind`` and ``prefix`` name them in the errors ("blocks h.0 and h.3 of the GPT2Model")."""
    if not layers:
        raise ValueError(f"from_torch: the {what} has no {kind}")
    reads = [read(layer, dtype) for layer in layers]
    block, _, norms = reads[0]
    for k, (other, _, _) in enumerate(reads[1:], start=1):
        if other != block:
            raise ValueError(f"from_torch: {kind} {prefix}0 and {prefix}{k} of the {what} differ ({block!r} and "
                             f"{other!r}); a ModelSpec stacks blocks of one spec")
    return block, norms, [own for _, own, _ in reads]


def _layer_arrays(spec: ModelSpec, layers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each layer's arrays under its prefixed names (h.<l>.W_Q, ...)."""
    return {spec.layer_prefix(k) + name: a for k, own in enumerate(layers) for name, a in own.items()}


def _has_biases(biases: dict[str, Any]) -> bool:
    """Whether the linear maps have biases: all of them or none (BlockSpec.bias is one switch)."""
    present = [name for name, b in biases.items() if b is not None]
    missing = [name for name, b in biases.items() if b is None]
    if present and missing:
        raise ValueError(f"from_torch: {', '.join(present)} present but {', '.join(missing)} missing; the family "
                         "has a bias on every linear map or on none (BlockSpec.bias)")
    return bool(present)


def _refuse_dropout(module: Any, dropouts: list[tuple[bool, float]]) -> None:
    """``dropouts``: (whether it applies now, probability) of each dropout the forward runs. One that
    applies makes the forward random, a function blockhess does not represent: a ValueError."""
    active = [p for training, p in dropouts if training and p > 0]
    if active:
        raise ValueError(f"from_torch: the {type(module).__name__} is in training mode with dropout (p = "
                         f"{max(active)}): its forward is random, and blockhess's model has no dropout; import it "
                         "in eval mode (module.eval()), the function blockhess represents")


def _encoder_layer(layer: Any, dtype: Any) -> tuple[BlockSpec, dict[str, np.ndarray], dict[str, Any]]:
    import torch

    nn = torch.nn
    _require_types(layer, {"": nn.TransformerEncoderLayer, "self_attn": nn.MultiheadAttention,
                           "linear1": nn.Linear, "linear2": nn.Linear, "dropout": nn.Dropout,
                           "dropout1": nn.Dropout, "dropout2": nn.Dropout})
    attention = layer.self_attn
    if not attention._qkv_same_embed_dim or attention.in_proj_weight is None:
        raise ValueError("from_torch: self-attention with separate key/value widths (kdim, vdim) is not supported")
    if attention.bias_k is not None or attention.add_zero_attn:
        raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
    _refuse_dropout(layer, [(layer.dropout.training, layer.dropout.p), (layer.dropout1.training, layer.dropout1.p),
                             (layer.dropout2.training, layer.dropout2.p), (attention.training, attention.dropout)])
    d = attention.embed_dim
    norms = {"norm1": layer.norm1, "norm2": layer.norm2}
    norm, affine = _norms(norms, d)
    biases = {"self_attn.in_proj_bias": attention.in_proj_bias, "self_attn.out_proj.bias": attention.out_proj.bias,
              "linear1.bias": layer.linear1.bias, "linear2.bias": layer.linear2.bias}
    bias = _has_biases(biases)
    spec = BlockSpec(norm_position="pre" if layer.norm_first else "post", norm=norm, norm_affine=affine, bias=bias,
                     heads=int(attention.num_heads), out_proj=True,
                     activation=_activation(layer.activation, "the layer's activation"), eps=_norm_eps(norms, dtype))
    W = _array(attention.in_proj_weight)
    arrays = {"W_Q": W[:d].T, "W_K": W[d:2 * d].T, "W_V": W[2 * d:].T, "W_O": _array(attention.out_proj.weight).T,
              "W_1": _array(layer.linear1.weight).T, "W_2": _array(layer.linear2.weight).T, **_norm_arrays(norms)}
    if bias:
        b = _array(attention.in_proj_bias)
        arrays.update(b_Q=b[:d], b_K=b[d:2 * d], b_V=b[2 * d:], b_O=_array(attention.out_proj.bias),
                      b_1=_array(layer.linear1.bias), b_2=_array(layer.linear2.bias))
    return spec, arrays, norms


def _run_encoder_layer(call: Callable[..., Any], layer: Any, X: Any) -> Any:
    # The layer's fused inference path (taken in eval mode) is not the forward autograd
    # differentiates: it reads cached flags and fails on norms without a bias. The layer's own
    # training flag keeps it out; its dropouts and attention stay in eval mode (_verify), so the
    # forward is the deterministic one.
    layer.training = True
    return _in_layout(call, layer, X)


def _in_layout(call: Callable[..., Any], layer: Any, X: Any) -> Any:
    """call on X (B, L, d) in the layout the layer's attention runs in, the result back in (B, L, d)."""
    if layer.self_attn.batch_first:  # what runs: the attention's layout (the layer passes its input on)
        return call(X)
    return call(X.transpose(0, 1)).transpose(0, 1)


def _encoder(encoder: Any, dtype: Any) -> tuple[ModelSpec, dict[str, np.ndarray], dict[str, Any]]:
    """Its layers, each read as a TransformerEncoderLayer (one configuration for all), and its final norm."""
    import torch

    _require_types(encoder, {"": torch.nn.TransformerEncoder})
    layers = list(encoder.layers)
    block, norms, owns = _read_layers(layers, _encoder_layer, dtype, "TransformerEncoder")
    spec = ModelSpec(block, n_layers=len(layers), final_norm=encoder.norm is not None)
    arrays = _layer_arrays(spec, owns)
    if encoder.norm is not None:  # of the layers' kind, affine alike and with their eps
        _norms({"layers.0.norm1": layers[0].norm1, "norm": encoder.norm}, int(layers[0].self_attn.embed_dim))
        arrays.update(_final_norm_arrays(encoder.norm))
    return spec, arrays, norms


def _run_encoder(call: Callable[..., Any], encoder: Any, X: Any) -> Any:
    # As for one layer (_run_encoder_layer): training flags keep the fused inference paths out (the
    # encoder's own checks its flag and its layers'); the dropouts stay in eval mode (_verify).
    encoder.training = True
    for layer in encoder.layers:
        layer.training = True
    return _in_layout(call, encoder.layers[0], X)


def _gpt2_block(block: Any, dtype: Any) -> tuple[BlockSpec, dict[str, np.ndarray], dict[str, Any]]:
    import torch
    from transformers.models.gpt2 import modeling_gpt2 as gpt2

    Conv1D, Dropout = gpt2.Conv1D, torch.nn.Dropout
    _require_types(block, {"": gpt2.GPT2Block, "attn": gpt2.GPT2Attention, "attn.c_attn": Conv1D,
                           "attn.c_proj": Conv1D, "attn.attn_dropout": Dropout, "attn.resid_dropout": Dropout,
                           "mlp": gpt2.GPT2MLP, "mlp.c_fc": Conv1D, "mlp.c_proj": Conv1D, "mlp.dropout": Dropout})
    attention, mlp = block.attn, block.mlp
    if getattr(block, "crossattention", None) is not None or attention.is_cross_attention:
        raise ValueError("from_torch: cross-attention is not supported")
    if not attention.is_causal:
        raise ValueError("from_torch: GPT-2 attention with is_causal=False is not supported (the family's GPT-2 "
                         "block is causal)")
    d, head_dim = attention.embed_dim, attention.head_dim
    if attention.split_size != d or d % head_dim:
        raise ValueError(f"from_torch: GPT-2 attention splits width {attention.split_size} into heads of "
                         f"{head_dim}; the family's heads split d = {d} evenly")
    if attention.scaling != head_dim ** -0.5:
        raise ValueError(f"from_torch: GPT-2 attention scales its scores by {attention.scaling}; the family's "
                         f"attention scales by 1/sqrt(head_dim) = {head_dim ** -0.5} only (scale_attn_weights=True, "
                         "scale_attn_by_inverse_layer_idx=False)")
    implementation = attention.config._attn_implementation
    if implementation not in (None, "eager", "sdpa"):
        raise ValueError(f"from_torch: GPT-2 attention implementation {implementation!r} is not supported "
                         "('eager' or 'sdpa')")
    if implementation != "sdpa" and attention.reorder_and_upcast_attn:
        raise ValueError("from_torch: GPT-2 attention with reorder_and_upcast_attn computes its scores in float32 "
                         "whatever the parameters' dtype, which blockhess's import cannot verify in float64; "
                         "import a copy with attn.reorder_and_upcast_attn = False (the same function in exact "
                         "arithmetic)")
    _refuse_dropout(block, [(attention.training, attention.attn_dropout.p),
                             (attention.resid_dropout.training, attention.resid_dropout.p),
                             (mlp.dropout.training, mlp.dropout.p)])
    norms = {"ln_1": block.ln_1, "ln_2": block.ln_2}
    norm, affine = _norms(norms, d)
    bias = _has_biases({"attn.c_attn.bias": attention.c_attn.bias, "attn.c_proj.bias": attention.c_proj.bias,
                        "mlp.c_fc.bias": mlp.c_fc.bias, "mlp.c_proj.bias": mlp.c_proj.bias})
    spec = BlockSpec(norm_position="pre", norm=norm, norm_affine=affine, bias=bias, heads=d // head_dim,
                     out_proj=True, activation=_activation(mlp.act, "mlp.act"), causal=True,
                     eps=_norm_eps(norms, dtype))
    W = _array(attention.c_attn.weight)  # Conv1D: (in, out)
    arrays = {"W_Q": W[:, :d], "W_K": W[:, d:2 * d], "W_V": W[:, 2 * d:], "W_O": _array(attention.c_proj.weight),
              "W_1": _array(mlp.c_fc.weight), "W_2": _array(mlp.c_proj.weight), **_norm_arrays(norms)}
    if bias:
        b = _array(attention.c_attn.bias)
        arrays.update(b_Q=b[:d], b_K=b[d:2 * d], b_V=b[2 * d:], b_O=_array(attention.c_proj.bias),
                      b_1=_array(mlp.c_fc.bias), b_2=_array(mlp.c_proj.bias))
    return spec, arrays, norms


def _run_gpt2_block(call: Callable[..., Any], block: Any, X: Any) -> Any:
    import torch

    # GPT-2's model hands each block its causal mask (additive, (B, 1, L, L)); the block alone
    # would attend to every key under eager attention.
    L = X.shape[1]
    mask = torch.full((L, L), float("-inf"), dtype=X.dtype, device=X.device).triu(1)[None, None]
    out = call(X, attention_mask=mask)
    return out[0] if isinstance(out, tuple) else out


def _gpt2_model(model: Any, dtype: Any) -> tuple[ModelSpec, dict[str, np.ndarray], dict[str, Any]]:
    """A GPT2Model, or a GPT2LMHeadModel's (its transformer) with the LM head tied to wte: the
    embeddings, each GPT2Block (one configuration for all), ln_f."""
    import torch
    from transformers.models.gpt2 import modeling_gpt2 as gpt2

    lm = isinstance(model, gpt2.GPT2LMHeadModel)
    if lm:
        _require_types(model, {"": gpt2.GPT2LMHeadModel, "transformer": gpt2.GPT2Model, "lm_head": torch.nn.Linear})
        if model.lm_head.weight is not model.transformer.wte.weight:
            raise ValueError("from_torch: the GPT2LMHeadModel's lm_head is not tied to transformer.wte (untied LM "
                             "heads are not supported; tie_word_embeddings=True ties them)")
        if model.lm_head.bias is not None:
            raise ValueError("from_torch: the GPT2LMHeadModel's lm_head has a bias, which GPT-2's tied head has not")
    transformer = model.transformer if lm else model
    _require_types(transformer, {"": gpt2.GPT2Model, "wte": torch.nn.Embedding, "wpe": torch.nn.Embedding,
                                 "drop": torch.nn.Dropout, "ln_f": torch.nn.LayerNorm})
    blocks = list(transformer.h)
    block_spec, norms, owns = _read_layers(blocks, _gpt2_block, dtype, "GPT2Model", kind="blocks", prefix="h.")
    for name in ("wte", "wpe"):
        embedding = getattr(transformer, name)
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError(f"from_torch: {name} is an nn.Embedding with max_norm, scale_grad_by_freq or sparse "
                             "set, which a plain lookup does not represent")
    _refuse_dropout(model, [(transformer.drop.training, transformer.drop.p)])
    d = int(transformer.wte.embedding_dim)
    _norms({"h.0.ln_1": blocks[0].ln_1, "ln_f": transformer.ln_f}, d)  # ln_f of the blocks' kind and eps
    spec = ModelSpec(block_spec, n_layers=len(blocks), final_norm=True, vocab_size=int(transformer.wte.num_embeddings),
                     n_positions=int(transformer.wpe.num_embeddings), lm_head=lm)
    arrays = {"wte": _array(transformer.wte.weight), "wpe": _array(transformer.wpe.weight),
              **_layer_arrays(spec, owns), **_final_norm_arrays(transformer.ln_f)}
    return spec, arrays, norms


def _run_gpt2_model(call: Callable[..., Any], model: Any, ids: Any) -> Any:
    """The logits of a GPT2LMHeadModel, the last hidden state of a GPT2Model, for token ids (B, L)."""
    out = call(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _vit(model: Any, dtype: Any) -> tuple[ModelSpec, dict[str, np.ndarray], dict[str, Any]]:
    """A ViTForImageClassification (its classifier on the class token's final state), or a ViTModel
    without a pooler: the patch embedding (a Conv2d of stride = kernel = p, read as a linear map of
    image_patches), the class token, the positions, each ViTLayer (pre-LN, one configuration for
    all), the final layernorm."""
    import torch
    from transformers.models.vit import modeling_vit as vit

    classifier = isinstance(model, vit.ViTForImageClassification)
    if classifier:
        _require_types(model, {"": vit.ViTForImageClassification, "vit": vit.ViTModel, "classifier": torch.nn.Linear})
        if model.classifier.bias is None:
            raise ValueError("from_torch: the ViT's classifier has no bias; the family's classifier has one")
    body = model.vit if classifier else model
    _require_types(body, {"": vit.ViTModel, "embeddings": vit.ViTEmbeddings,
                          "embeddings.patch_embeddings": vit.ViTPatchEmbeddings,
                          "embeddings.patch_embeddings.projection": torch.nn.Conv2d, "embeddings.dropout": torch.nn.Dropout,
                          "layernorm": torch.nn.LayerNorm})
    if body.pooler is not None:
        raise ValueError("from_torch: the ViTModel has a pooler (a tanh layer on the class token), which the model "
                         "does not represent; build it with add_pooling_layer=False")
    if body.embeddings.mask_token is not None:
        raise ValueError("from_torch: the ViT has a mask token (masked image modeling), which the model does not "
                         "represent; build it with use_mask_token=False")
    conv = body.embeddings.patch_embeddings.projection
    p = tuple(conv.kernel_size)
    if p[0] != p[1] or tuple(conv.stride) != p or any(conv.padding) or tuple(conv.dilation) != (1, 1) \
            or conv.groups != 1 or conv.bias is None or conv.padding_mode != "zeros":
        raise ValueError("from_torch: the ViT's patch embedding must be a Conv2d with square kernel = stride, no "
                         "padding, dilation or groups, and a bias (a linear map of non-overlapping patches)")
    layers = list(body.layers)
    block, norms, owns = _read_layers(layers, _vit_layer, dtype, "ViT")
    d = int(conv.out_channels)
    _norms({"layers.0.layernorm_before": layers[0].layernorm_before, "layernorm": body.layernorm}, d)
    _refuse_dropout(model, [(body.embeddings.dropout.training, body.embeddings.dropout.p)])
    positions = int(body.embeddings.position_embeddings.shape[1])
    spec = ModelSpec(block, n_layers=len(layers), final_norm=True, patch_dim=int(conv.in_channels) * p[0] * p[1],
                     n_positions=positions, classes=int(model.classifier.out_features) if classifier else 0,
                     class_token=True)
    arrays = {"W_E": _array(conv.weight).reshape(d, -1).T, "b_E": _array(conv.bias),
              "cls_token": _array(body.embeddings.cls_token).reshape(d),
              "wpe": _array(body.embeddings.position_embeddings).reshape(positions, d),
              **_layer_arrays(spec, owns), **_final_norm_arrays(body.layernorm)}
    if classifier:
        arrays.update(W_C=_array(model.classifier.weight).T, b_C=_array(model.classifier.bias))
    return spec, arrays, norms


def _vit_layer(layer: Any, dtype: Any) -> tuple[BlockSpec, dict[str, np.ndarray], dict[str, Any]]:
    """One ViTLayer: pre-LN, bidirectional attention with W_O, an MLP; nn.Linear weights transposed."""
    import torch
    from transformers.models.vit import modeling_vit as vit

    Linear = torch.nn.Linear
    _require_types(layer, {"": vit.ViTLayer, "attention": vit.ViTAttention, "attention.q_proj": Linear,
                           "attention.k_proj": Linear, "attention.v_proj": Linear, "attention.o_proj": Linear,
                           "mlp": vit.ViTMLP, "mlp.fc1": Linear, "mlp.fc2": Linear, "dropout": torch.nn.Dropout})
    attention, mlp = layer.attention, layer.mlp
    head_dim, heads = attention.head_dim, attention.num_attention_heads
    if attention.scaling != head_dim ** -0.5 or attention.is_causal:
        raise ValueError("from_torch: the ViT's attention must scale by 1/sqrt(head_dim) and attend both ways")
    implementation = attention.config._attn_implementation
    if implementation not in (None, "eager", "sdpa"):
        raise ValueError(f"from_torch: ViT attention implementation {implementation!r} is not supported "
                         "('eager' or 'sdpa')")
    _refuse_dropout(layer, [(layer.dropout.training, layer.dropout.p),
                             (attention.training, attention.attention_dropout)])
    norms = {"layernorm_before": layer.layernorm_before, "layernorm_after": layer.layernorm_after}
    d = int(attention.q_proj.in_features)
    norm, affine = _norms(norms, d)
    linears = {"q_proj": attention.q_proj, "k_proj": attention.k_proj, "v_proj": attention.v_proj,
               "o_proj": attention.o_proj, "fc1": mlp.fc1, "fc2": mlp.fc2}
    bias = _has_biases({f"{n}.bias": m.bias for n, m in linears.items()})
    spec = BlockSpec(norm_position="pre", norm=norm, norm_affine=affine, bias=bias, heads=heads, out_proj=True,
                     activation=_activation(mlp.activation_fn, "mlp.activation_fn"), causal=False,
                     eps=_norm_eps(norms, dtype))
    weights = {"W_Q": "q_proj", "W_K": "k_proj", "W_V": "v_proj", "W_O": "o_proj", "W_1": "fc1", "W_2": "fc2"}
    arrays = {name: _array(linears[own].weight).T for name, own in weights.items()}
    arrays.update(_norm_arrays(norms))
    if bias:
        arrays.update({"b" + name[1:]: _array(linears[own].bias) for name, own in weights.items()})
    return spec, arrays, norms


def _run_vit(call: Callable[..., Any], model: Any, patches: Any) -> Any:
    """The ViT's output (a classifier's logits, else the last hidden state) for patches (B, n, C p p),
    laid back out as the (B, C, H, W) images they were cut from."""
    import torch

    config = model.config
    p, C, size = config.patch_size, config.num_channels, config.image_size
    B, grid = patches.shape[0], size // p
    images = patches.reshape(B, grid, grid, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, size, size)
    # Hugging Face's eager ViT attention takes its softmax in float32 whatever the dtype: run the
    # same function through sdpa's math kernel, in the parameters' dtype, and put the choice back.
    chosen = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = call(pixel_values=images)
    finally:
        config._attn_implementation = chosen
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _verify(module: Any, run: Callable[..., Any], params: BlockParams, norms: dict[str, Any]) -> None:
    """Raise ValueError unless the module's forward (eval mode, float64 copies of its parameters and
    buffers, grad enabled) equals blockhess's forward of ``params`` on a random input."""
    import torch

    device = next(module.parameters()).device
    rng = np.random.default_rng(0)  # torch's RNG is the caller's
    if params.spec.reads_tokens:  # a language model's token ids
        X = rng.integers(0, params.spec.vocab_size, size=_VERIFY_SHAPE)
    elif params.spec.class_token:  # a ViT's patches: all of them, its positions fixed
        X = rng.standard_normal((_VERIFY_SHAPE[0], params.spec.n_positions - 1, params.spec.patch_dim))
    else:
        X = rng.standard_normal((*_VERIFY_SHAPE, params.d))
    tensors = {name: p.detach().to(torch.float64).requires_grad_() for name, p in module.named_parameters()}
    tensors.update({name: b.to(torch.float64) if b.is_floating_point() else b
                    for name, b in module.named_buffers()})
    training = {m: m.training for m in module.modules()}
    module.eval()
    try:  # grad enabled (and parameters that require it) keeps torch's fused inference paths out
        with torch.enable_grad():
            def call(*args: Any, **kwargs: Any) -> Any:
                return torch.func.functional_call(module, tensors, args, kwargs)

            Z = run(call, module, torch.as_tensor(X, device=device)).detach().cpu().numpy()
    except Exception as err:  # noqa: BLE001 - whatever the module raises, the import cannot be verified
        raise ValueError(f"from_torch: the {type(module).__name__} could not be run on float64 copies of its "
                         f"parameters to verify the import ({type(err).__name__}: {err})") from err
    finally:
        for m, flag in training.items():
            m.training = flag
    # in float64 (a language model's token ids do not promote float32 parameters, as X does)
    params64 = BlockParams.from_arrays(params.spec, {n: np.asarray(a, dtype=np.float64)
                                                     for n, a in zip(params.names, params.arrays)})
    expected = block_forward(X, params64, eps=_norm_eps(norms, torch.float64))
    if params.spec.classes and params.spec.class_token:  # the module's logits are its class token's
        expected = expected[:, 0]
    difference = float(np.linalg.norm(Z - expected) / np.linalg.norm(expected)) if Z.shape == expected.shape else np.inf
    if not difference <= _VERIFY_RTOL:
        raise ValueError(f"from_torch: the {type(module).__name__} computes something that blockhess's import of it "
                         f"({params.spec!r}) does not represent: on a random input their outputs differ by "
                         f"{difference:.2g} (relative, in float64); a patched forward or a forward hook?")
