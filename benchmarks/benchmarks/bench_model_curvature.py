"""Exact curvature of a whole model and the approximation oracle, on the 2-block ViT of the shape of
blockhess.experiments (d = 16, d_ff = 64, 16 tokens of 4 pixels, P = 6,522), random weights, 16
images, float64, 2 threads:

- the dense loss Hessian with every cross-layer block (from one product per parameter below the
  last block's attention: docs/derivation.md §5.4) against ``torch.func.hessian`` of the same model
  written from its definition (the torch reference's stack);
- ``blockhess.approximations.compare`` (the exact Hessian and Gauss-Newton matrix, K-FAC, EKFAC,
  the nearest Kronecker products, the diagonals, the layer-wise matrix) in seconds (target: the
  command's whole run under 2 minutes on 2 cores);
- per-block traces of a 4-layer GPT-2-shaped language model (d = 256, L = 128, a 512-token
  vocabulary): exact against torch's 100-probe Hutchinson estimate, and blockhess's estimate against
  torch's.
"""

from __future__ import annotations

import time
import timeit

import numpy as np

from . import _settings
from ._harness import blockhess_api
from ._torch_methods import torch

IMAGES = 16


def _vit():
    ModelSpec, BlockParams, BlockSpec = blockhess_api("ModelSpec", "BlockParams", "BlockSpec")
    if "patch_dim" not in getattr(ModelSpec, "__dataclass_fields__", {}):
        raise NotImplementedError("blockhess has no ViTs at this commit")
    spec = ModelSpec(BlockSpec(norm_affine=True, bias=True), n_layers=2, patch_dim=4, n_positions=16, classes=10)
    params = BlockParams.random(spec, d=16, d_k=16, d_ff=64, seed=_settings.SEED)
    rng = np.random.default_rng(_settings.SEED)
    return spec, params, rng.standard_normal((IMAGES, 16, 4)), rng.integers(0, 10, size=IMAGES)


class RatiosViTDenseHessian:
    timeout = 1800

    def setup_cache(self):
        spec, params, X, labels = _vit()
        loss_hessian = blockhess_api("loss_hessian")
        t = torch()
        from blockhess._torch_reference import loss as reference_loss
        from blockhess._torch_reference import stack

        def scalar(v):
            named = {n: v[sl].reshape(shape) for (n, sl), shape in zip(params.slices().items(), params.shapes)}
            return reference_loss(stack(t.as_tensor(X), spec, named, 0.0), t.as_tensor(labels), "pooled_cross_entropy")

        flat = t.as_tensor(params.flatten())
        ours = min(timeit.repeat(lambda: loss_hessian(X, labels, params, loss="pooled_cross_entropy"), number=1,
                                 repeat=2))
        start = time.perf_counter()
        t.func.hessian(scalar)(flat)
        theirs = time.perf_counter() - start
        return {"torch_over_blockhess": theirs / ours, "blockhess_seconds": ours}

    def track_torch_hessian_over_blockhess(self, ratios):
        return ratios["torch_over_blockhess"]

    def track_blockhess_dense_hessian_seconds(self, ratios):
        return ratios["blockhess_seconds"]

    track_torch_hessian_over_blockhess.unit = "ratio"
    track_blockhess_dense_hessian_seconds.unit = "seconds"


class TimeViTApproximations:
    timeout = 1800

    def setup_cache(self):
        _, params, X, labels = _vit()
        try:
            from blockhess import approximations
        except ImportError as err:
            raise NotImplementedError("blockhess has no approximations module at this commit") from err

        start = time.perf_counter()
        approximations.compare(X, labels, params, loss="pooled_cross_entropy")
        return time.perf_counter() - start

    def track_compare_seconds(self, seconds):
        return seconds

    track_compare_seconds.unit = "seconds"


def _language_model():
    """A 4-layer GPT-2-shaped language model (pre-LN, 4 heads of 64, W_O, GELU, causal, tied LM head,
    d = 256, d_ff = 1024, a 512-token vocabulary, P = 3,323,392) at one sequence of 128 tokens."""
    ModelSpec, BlockParams, BlockSpec = blockhess_api("ModelSpec", "BlockParams", "BlockSpec")
    if "vocab_size" not in getattr(ModelSpec, "__dataclass_fields__", {}):
        raise NotImplementedError("blockhess has no language models at this commit")
    block = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=4, out_proj=True, activation="gelu",
                      causal=True)
    spec = ModelSpec(block, n_layers=4, vocab_size=512, n_positions=128, lm_head=True, final_norm=True)
    params = BlockParams.random(spec, d=256, d_k=64, d_ff=1024, seed=_settings.SEED)
    ids = np.random.default_rng(_settings.SEED).integers(0, 512, size=(1, 128))
    return spec, params, ids


class RatiosLanguageModelTraces:
    """Per-block traces of the 4-layer language model: exact (blockhess, from the per-token factors:
    the top block and the final norm, the parameters the factors reach; a lower block's would take one
    product per parameter) against a 100-probe Hutchinson estimate through torch's double-backward
    Hessian-vector products of the same model written from its definition, for the same parameters
    and for all of them; and blockhess's own 100-probe estimate of every parameter's traces."""

    timeout = 1800
    PROBES = 100

    def setup_cache(self):
        spec, params, ids = _language_model()
        hessian_operator, memory_budget = blockhess_api("hessian_operator", "memory_budget")
        t = torch()
        from blockhess._torch_reference import loss as reference_loss
        from blockhess._torch_reference import stack

        top = tuple(n for n in params.names if n.startswith(("h.3.", "ln_f.")))
        with memory_budget(12 * 2**30):  # the exact traces' factors take about 3 GB
            op = hessian_operator(ids, ids, params, loss="next_token", wrt=top)
            start = time.perf_counter()
            op.trace(by_block=True)
            exact_top = time.perf_counter() - start
        op = hessian_operator(ids, ids, params, loss="next_token")
        start = time.perf_counter()
        op.trace(by_block=True, exact=False, probes=self.PROBES, seed=0)
        estimate_all = time.perf_counter() - start

        named = {n: t.tensor(np.asarray(params[n]), requires_grad=True) for n in params.names}
        tokens = t.as_tensor(ids)
        generator = t.Generator().manual_seed(_settings.SEED)

        def torch_hutchinson(chosen):
            weights = [named[n] for n in chosen]
            start = time.perf_counter()
            for _ in range(self.PROBES):
                g = t.autograd.grad(reference_loss(stack(tokens, spec, named), tokens, "next_token"), weights,
                                    create_graph=True)
                v = [t.randint(0, 2, w.shape, generator=generator, dtype=w.dtype) * 2 - 1 for w in weights]
                Hv = t.autograd.grad(g, weights, grad_outputs=v)
                [float((a * b).sum()) for a, b in zip(v, Hv)]
            return time.perf_counter() - start

        torch_top, torch_all = torch_hutchinson(top), torch_hutchinson(params.names)
        return {"exact_top": exact_top, "torch_top": torch_top, "torch_all": torch_all, "estimate_all": estimate_all}

    def track_torch_hutchinson_top_over_blockhess_exact_top(self, r):
        return r["torch_top"] / r["exact_top"]

    def track_torch_hutchinson_all_over_blockhess_hutchinson_all(self, r):
        return r["torch_all"] / r["estimate_all"]

    def track_blockhess_exact_top_seconds(self, r):
        return r["exact_top"]

    def track_torch_hutchinson_top_seconds(self, r):
        return r["torch_top"]

    track_torch_hutchinson_top_over_blockhess_exact_top.unit = "ratio"
    track_torch_hutchinson_all_over_blockhess_hutchinson_all.unit = "ratio"
    track_blockhess_exact_top_seconds.unit = "seconds"
    track_torch_hutchinson_top_seconds.unit = "seconds"
