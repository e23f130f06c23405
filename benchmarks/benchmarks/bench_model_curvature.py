"""Exact curvature of a whole model and the approximation oracle, on the 2-block ViT of the shape of
blockhess.experiments (d = 16, d_ff = 64, 16 tokens of 4 pixels, P = 6,522), random weights, 16
images, float64, 2 threads:

- the dense loss Hessian with every cross-layer block (from one product per parameter below the
  last block's attention: docs/derivation.md §5.4) against ``torch.func.hessian`` of the same model
  written from its definition (the torch reference's stack);
- ``blockhess.approximations.compare`` (the exact Hessian and Gauss-Newton matrix, K-FAC, EKFAC,
  the nearest Kronecker products, the diagonals, the layer-wise matrix) in seconds (target: the
  command's whole run under 2 minutes on 2 cores).
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
