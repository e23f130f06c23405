"""The block family (blockhess.BlockSpec) against torch, in one process.

- "everything on" at the paper's MNIST size: L=49, d=16, 4 heads of d_k = d_v = 4 with W_O, d_ff=64,
  pre-LN, affine LayerNorms, biases, gelu, causal (P = 3,280): the full loss Hessian, blockhess
  against ``torch.func.hessian`` of the torch reference of the family. Target: >= 20x.
- a GPT-2-small-shaped block (L=128, d=768, 12 heads, d_ff=3072, everything GPT-2 has; float32,
  P = 7.1 million): ``loss_hvp`` against a torch gradient and torch's double-backward HVP of the same
  loss. Targets: <= 2x the gradient, faster than the HVP.
- a stack of 4 GPT-2-like blocks (blockhess.ModelSpec; L=128, d=256, 4 heads of 64, d_ff=1024, float32,
  P = 3.2 million): ``loss_hvp`` against a torch gradient and torch's double-backward HVP of the
  same loss (the whole-model targets: <= 2.5x the gradient, >= 1.3x faster than the HVP).
The ``track_`` benchmarks report the ratios, each measured one method right after the other.
"""

from __future__ import annotations

import timeit

import numpy as np

from . import _settings
from ._harness import blockhess_api
from ._torch_methods import reference, torch

EVERYTHING = dict(norm_position="pre", norm_affine=True, bias=True, heads=4, out_proj=True, activation="gelu",
                  causal=True, eps=1e-5)
GPT2 = dict(norm_position="pre", norm_affine=True, bias=True, heads=12, out_proj=True, activation="gelu_tanh",
            causal=True, eps=1e-5)


def _problem(spec_options, L, d, d_k, d_ff, dtype, layers=1):
    BlockSpec, BlockParams = blockhess_api("BlockSpec", "BlockParams")
    spec = BlockSpec(**spec_options)
    if layers > 1:  # a commit without stacks has no ModelSpec: NotImplementedError, skipped by asv
        spec = blockhess_api("ModelSpec")(spec, n_layers=layers)
    params = BlockParams.random(spec, d=d, d_k=d_k, d_ff=d_ff, seed=_settings.SEED, dtype=dtype)
    rng = np.random.default_rng(_settings.SEED)
    X, target = rng.standard_normal((L, d)).astype(dtype), rng.standard_normal((L, d)).astype(dtype)
    return spec, params, X, target


def _torch_loss(spec, params, X, target):
    t, ref = torch(), reference()
    output_of = ref.family_of_flat(t.from_numpy(X), spec, params.names, params.shapes)
    T = t.from_numpy(target)
    return (lambda v: ((output_of(v) - T) ** 2).mean()), t.from_numpy(np.array(params.flatten()))


def _seconds(fn, repeat=3):
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


class TimeEverythingOnHessian:
    params = (["blockhess", "torch.func.hessian"],)
    param_names = ("method",)
    timeout = 600

    def setup(self, method):
        spec, params, X, target = _problem(EVERYTHING, 49, 16, 4, 64, np.float64)
        if method == "blockhess":
            loss_hessian = blockhess_api("loss_hessian")
            self.fn = lambda: loss_hessian(X, target, params)
        else:
            loss, v = _torch_loss(spec, params, X, target)
            self.fn = lambda: torch().func.hessian(loss)(v)

    def time_everything_on_hessian(self, method):
        self.fn()


class RatioEverythingOnHessian:
    timeout = 600

    def track_torch_hessian_over_blockhess(self):
        spec, params, X, target = _problem(EVERYTHING, 49, 16, 4, 64, np.float64)
        loss_hessian = blockhess_api("loss_hessian")
        loss, v = _torch_loss(spec, params, X, target)
        return _seconds(lambda: torch().func.hessian(loss)(v), 1) / _seconds(lambda: loss_hessian(X, target, params))

    track_torch_hessian_over_blockhess.unit = "ratio"


def _hvp_ratios(spec, params, X, target):
    """loss_hvp over a torch gradient, and torch's double-backward HVP over loss_hvp, one right after
    the other."""
    loss_hvp = blockhess_api("loss_hvp")
    v = np.random.default_rng(1).standard_normal(params.size).astype(np.float32)
    loss, flat = _torch_loss(spec, params, X, target)
    t = torch()
    flat.requires_grad_(True)
    vt = t.from_numpy(v)

    def hvp():
        (g,) = t.autograd.grad(loss(flat), flat, create_graph=True)
        return t.autograd.grad(g, flat, grad_outputs=vt)[0]

    ours = _seconds(lambda: loss_hvp(X, target, params, v))
    gradient = _seconds(lambda: t.autograd.grad(loss(flat), flat)[0])
    return {"hvp_over_gradient": ours / gradient, "torch_hvp_over_hvp": _seconds(hvp) / ours}


class RatiosGPT2HVP:
    timeout = 900

    def setup_cache(self):
        return _hvp_ratios(*_problem(GPT2, 128, 768, 64, 3072, np.float32))

    def track_hvp_over_torch_gradient(self, ratios):
        return ratios["hvp_over_gradient"]

    def track_torch_hvp_over_hvp(self, ratios):
        return ratios["torch_hvp_over_hvp"]

    track_hvp_over_torch_gradient.unit = "ratio"
    track_torch_hvp_over_hvp.unit = "ratio"


class RatiosStackHVP(RatiosGPT2HVP):
    def setup_cache(self):
        return _hvp_ratios(*_problem(dict(GPT2, heads=4), 128, 256, 64, 1024, np.float32, layers=4))
