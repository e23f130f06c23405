"""from_torch imports what the module computes, or raises (issue 25): it reads the submodules that
run (not cached flags or the config), refuses subclasses and what the family cannot represent with
messages that name it, verifies the import against the module's own forward, and leaves the
caller's module as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import blockhess

d, heads, d_ff = 4, 2, 6


def _layer(**options) -> torch.nn.TransformerEncoderLayer:
    options = {"dropout": 0.0, "batch_first": True, "dtype": torch.float64, **options}
    layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=d_ff, **options)
    with torch.no_grad():  # away from the defaults (gamma = 1, beta = 0)
        for p in layer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    return layer.eval()


def _gpt2_block(layer_idx=None, **config):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = {"attn_implementation": "eager", "attn_pdrop": 0.0, "resid_pdrop": 0.0, **config}
    config = transformers.GPT2Config(n_embd=d, n_head=heads, n_layer=1, n_positions=16, n_inner=d_ff, **config)
    torch.manual_seed(0)
    block = GPT2Block(config, layer_idx=layer_idx).double()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return block.eval()


def _module_forward(module, X):
    """The module's own forward on X (B, L, d), on the autograd path (grad enabled, train mode with
    dropout 0, so torch's fused inference kernels do not stand in for it); GPT-2 gets the causal mask
    its model would hand it."""
    X = torch.as_tensor(X)
    training = module.training
    module.train()
    try:
        with torch.enable_grad():
            if isinstance(module, torch.nn.TransformerEncoderLayer):
                return module(X).detach().numpy()
            L = X.shape[1]
            mask = torch.full((L, L), float("-inf"), dtype=X.dtype).triu(1)[None, None]
            out = module(X, attention_mask=mask)
            return (out[0] if isinstance(out, tuple) else out).detach().numpy()
    finally:
        module.train(training)


def _assert_imports_module(module, rtol=1e-12):
    """from_torch(module) and blockhess's forward of it equal the module's forward."""
    spec, params = blockhess.from_torch(module)
    X = np.random.default_rng(7).standard_normal((2, 5, d))
    Z, Z_module = blockhess.block_forward(X, params), _module_forward(module, X)
    assert np.linalg.norm(Z - Z_module) <= rtol * np.linalg.norm(Z_module)
    return spec


# ---- read what runs ------------------------------------------------------------------------------

def test_gelu_tanh_module_is_imported_as_gelu_tanh():
    # torch caches activation_relu_or_gelu = 2 for any nn.GELU (its fused kernel then runs erf GELU),
    # but the forward that autograd differentiates calls the module: the tanh form.
    spec = _assert_imports_module(_layer(activation=torch.nn.GELU(approximate="tanh")))
    assert spec.activation == "gelu_tanh"


@pytest.mark.parametrize("activation, name", [(torch.nn.functional.gelu, "gelu"), (torch.nn.SiLU(), "silu")])
def test_activation_replaced_after_construction_is_the_one_imported(activation, name):
    layer = _layer(activation="relu")
    layer.activation = activation  # activation_relu_or_gelu still says relu
    assert _assert_imports_module(layer).activation == name


def test_gpt2_activation_is_read_from_mlp_act():
    block = _gpt2_block(activation_function="gelu_new")
    block.mlp.act = torch.nn.ReLU()  # config.activation_function still says gelu_new
    assert _assert_imports_module(block).activation == "relu"
    block.mlp.act = torch.nn.Tanh()
    with pytest.raises(ValueError, match=r"mlp.act is Tanh\(\), not an activation of the family"):
        blockhess.from_torch(block)


def test_gpt2_attention_scaling_is_read_from_the_attention():
    block = _gpt2_block()
    block.attn.scaling = 1.0  # config.scale_attn_weights still says 1/sqrt(head_dim)
    with pytest.raises(ValueError, match="scales its scores by 1.0"):
        blockhess.from_torch(block)
    with pytest.raises(ValueError, match="scales its scores by"):
        blockhess.from_torch(_gpt2_block(layer_idx=1, scale_attn_by_inverse_layer_idx=True))
    # Scaled by 1/(layer_idx + 1) at layer 0: exactly GPT-2's scaling, imported.
    assert _assert_imports_module(_gpt2_block(layer_idx=0, scale_attn_by_inverse_layer_idx=True)).heads == heads


def test_gpt2_attention_implementations():
    assert _assert_imports_module(_gpt2_block(attn_implementation="sdpa")).causal
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        blockhess.from_torch(_gpt2_block(reorder_and_upcast_attn=True))
    block = _gpt2_block()
    block.attn.is_causal = False
    with pytest.raises(ValueError, match="is_causal=False"):
        blockhess.from_torch(block)


# ---- subclasses ----------------------------------------------------------------------------------

class ScaledLayer(torch.nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):
        return 2 * super().forward(src, *args, **kwargs)


class ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class ShiftedGELU(torch.nn.GELU):
    def forward(self, x):
        return super().forward(x) + 1


def test_subclass_of_the_layer_is_refused_naming_it():
    layer = ScaledLayer(d, heads, dim_feedforward=d_ff, dropout=0.0, dtype=torch.float64).eval()
    with pytest.raises(TypeError, match="the module is a ScaledLayer, not a TransformerEncoderLayer"):
        blockhess.from_torch(layer)


def test_subclass_of_a_submodule_that_runs_is_refused_naming_it():
    layer = _layer()
    layer.linear2 = ScaledLinear(d_ff, d, dtype=torch.float64)
    with pytest.raises(TypeError, match="linear2 is a ScaledLinear, not a Linear"):
        blockhess.from_torch(layer)
    layer = _layer(activation=ShiftedGELU())
    with pytest.raises(TypeError, match="ShiftedGELU"):
        blockhess.from_torch(layer)


def test_subclass_of_gpt2_block_is_refused_naming_it():
    GPT2Block = pytest.importorskip("transformers.models.gpt2.modeling_gpt2").GPT2Block

    class DoubledBlock(GPT2Block):
        def forward(self, *args, **kwargs):
            return 2 * super().forward(*args, **kwargs)

    block = DoubledBlock(_gpt2_block().attn.config).double().eval()
    with pytest.raises(TypeError, match="DoubledBlock, not a GPT2Block"):
        blockhess.from_torch(block)


# ---- the import is verified against the module ---------------------------------------------------

def test_a_forward_hook_that_changes_the_output_is_caught():
    layer = _layer()
    layer.linear2.register_forward_hook(lambda module, inputs, output: 1.5 * output)
    with pytest.raises(ValueError, match="computes something that blockhess's import of it .* does not represent"):
        blockhess.from_torch(layer)
    block = _gpt2_block()
    block.register_forward_hook(lambda module, inputs, output: output + 1e-6)
    with pytest.raises(ValueError, match=r"differ by \d"):
        blockhess.from_torch(block)


def test_a_patched_forward_is_caught():
    layer = _layer()
    forward = layer.forward
    layer.forward = lambda src, *args, **kwargs: forward(src, *args, **kwargs).flip(1)  # tokens reversed
    with pytest.raises(ValueError, match="does not represent"):
        blockhess.from_torch(layer)


def test_a_module_that_cannot_run_in_float64_is_a_clear_error():
    layer = _layer(dtype=torch.float32)
    layer.linear1.register_forward_hook(lambda module, inputs, output: output.float())  # float32 into float64
    with pytest.raises(ValueError, match="could not be run on float64 copies of its parameters"):
        blockhess.from_torch(layer)


def test_the_callers_module_is_left_as_it_was():
    layer = _layer(dtype=torch.float32, dropout=0.0).train()
    layer.linear1.eval()  # flags that differ between submodules come back as they were
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    identities = {name: id(p) for name, p in layer.named_parameters()}
    flags = {name: m.training for name, m in layer.named_modules()}
    rng_state = torch.get_rng_state()
    spec, params = blockhess.from_torch(layer)
    assert params.dtype == np.float32
    for name, p in layer.named_parameters():
        assert p.dtype == torch.float32 and p.grad is None and id(p) == identities[name]
        assert torch.equal(p, before[name])
    assert {name: m.training for name, m in layer.named_modules()} == flags
    assert torch.equal(torch.get_rng_state(), rng_state)


# ---- what the family cannot represent, named; what it can, imported ------------------------------

def test_bias_false_layer_whose_linear2_has_a_bias_is_refused():
    layer = _layer(bias=False)
    layer.norm1 = torch.nn.LayerNorm(d, dtype=torch.float64)  # affine norms with beta, as the family has
    layer.norm2 = torch.nn.LayerNorm(d, dtype=torch.float64)
    layer.linear2 = torch.nn.Linear(d_ff, d, dtype=torch.float64)  # with a bias
    with pytest.raises(ValueError, match=r"linear2.bias present but self_attn.in_proj_bias, "
                                         r"self_attn.out_proj.bias, linear1.bias missing"):
        blockhess.from_torch(layer)


def test_some_biases_missing_are_refused_naming_them():
    layer = _layer()
    layer.linear1.bias = None
    with pytest.raises(ValueError, match=r"self_attn.in_proj_bias, self_attn.out_proj.bias, linear2.bias present "
                                         r"but linear1.bias missing; .*BlockSpec.bias"):
        blockhess.from_torch(layer)
    block = _gpt2_block()
    block.mlp.c_proj.bias = None
    with pytest.raises(ValueError, match="mlp.c_proj.bias missing"):
        blockhess.from_torch(block)


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm_norms_are_imported(eps, affine):
    layer = _layer(norm_first=True)
    layer.norm1 = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=affine, dtype=torch.float64)
    layer.norm2 = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=affine, dtype=torch.float64)
    if affine:
        with torch.no_grad():
            layer.norm1.weight.add_(0.5)
            layer.norm2.weight.sub_(0.25)
    spec = _assert_imports_module(layer)
    # nn.RMSNorm's eps=None is the machine epsilon of the input's dtype.
    assert (spec.norm, spec.norm_affine) == ("rmsnorm", affine)
    assert spec.eps == (np.finfo(np.float64).eps if eps is None else eps)
    block = _gpt2_block()
    block.ln_1, block.ln_2 = (torch.nn.RMSNorm(d, eps=eps, elementwise_affine=affine, dtype=torch.float64)
                              for _ in range(2))
    assert _assert_imports_module(block).norm == "rmsnorm"


def test_rmsnorm_eps_none_follows_the_float32_dtype():
    layer = _layer(dtype=torch.float32)
    layer.norm1, layer.norm2 = (torch.nn.RMSNorm(d, dtype=torch.float32) for _ in range(2))
    spec, params = blockhess.from_torch(layer)
    assert spec.eps == np.finfo(np.float32).eps and params.dtype == np.float32
    X = np.random.default_rng(3).standard_normal((2, 5, d)).astype(np.float32)
    Z_module = _module_forward(layer, X)
    assert np.linalg.norm(blockhess.block_forward(X, params) - Z_module) <= 1e-5 * np.linalg.norm(Z_module)


def test_plain_layernorms_are_imported():
    layer = _layer()
    layer.norm1, layer.norm2 = (torch.nn.LayerNorm(d, eps=1e-4, elementwise_affine=False, dtype=torch.float64)
                                for _ in range(2))
    spec = _assert_imports_module(layer)
    assert (spec.norm, spec.norm_affine, spec.eps) == ("layernorm", False, 1e-4)


def test_norms_that_disagree_are_refused():
    layer = _layer()
    layer.norm2 = torch.nn.RMSNorm(d, eps=1e-5, dtype=torch.float64)
    with pytest.raises(ValueError, match="norm1 and norm2 are a LayerNorm and a RMSNorm"):
        blockhess.from_torch(layer)
    layer = _layer()
    layer.norm2 = torch.nn.LayerNorm(d, elementwise_affine=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="only norm1 has a gamma"):
        blockhess.from_torch(layer)
    layer = _layer()
    layer.norm2 = torch.nn.GroupNorm(1, d, dtype=torch.float64)
    with pytest.raises(TypeError, match="norm2 is a GroupNorm"):
        blockhess.from_torch(layer)


def test_meta_and_low_precision_modules_are_refused_clearly():
    with pytest.raises(ValueError, match="from_torch: the module's parameters are on the meta device"):
        blockhess.from_torch(torch.nn.TransformerEncoderLayer(d, heads, d_ff, device="meta"))
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match=rf"from_torch: the module's parameters are {dtype}; .*\.float\(\)"):
            blockhess.from_torch(torch.nn.TransformerEncoderLayer(d, heads, d_ff, dtype=dtype))
    layer = _layer()
    layer.linear1.to(torch.float32)
    with pytest.raises(TypeError, match="mix dtypes"):
        blockhess.from_torch(layer)

