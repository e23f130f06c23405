"""The exact Hessian-vector product of the block's MSE loss, at (L, d, d_k, d_ff) = (128, 256, 256,
1024) (P = 720,896: the dense Hessian would take 4 TB), float64 and float32.

Methods: ``blockhess.loss_hvp`` (forward, reverse and one product), one product of a cached
``blockhess.hessian_operator``, a torch gradient of the same loss (forward + backward) and torch's
double-backward HVP. Targets: loss_hvp <= 2x the torch gradient, >= 1.5x faster than torch's HVP;
the ``track_`` benchmarks measure those ratios in one process, one right after the other.
"""

from __future__ import annotations

import timeit

import numpy as np

from . import _settings
from ._harness import blockhess_api
from ._torch_methods import reference, torch

HVP_SHAPES = [(128, 256, 256, 1024)]  # (L, d, d_k, d_ff)
DTYPES = ["float64", "float32"]
METHODS = ["blockhess loss_hvp", "blockhess operator product", "torch gradient", "torch double-backward HVP"]


def _inputs(shape, dtype):
    L, d, dk, dff = shape
    rng = np.random.default_rng(_settings.SEED)
    weights = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype) for s in [(d, dk), (d, dk), (d, d), (d, dff), (dff, d)]]
    X, target = rng.standard_normal((L, d)).astype(dtype), rng.standard_normal((L, d)).astype(dtype)
    v = rng.standard_normal(sum(w.size for w in weights)).astype(dtype)
    return X, target, weights, v


def build(method, shape, dtype):
    """A zero-argument callable doing the timed work of ``method``."""
    X, target, weights, v = _inputs(shape, dtype)
    if method.startswith("blockhess"):
        BlockParams, loss_hvp, hessian_operator = blockhess_api("BlockParams", "loss_hvp", "hessian_operator")
        params = BlockParams(*weights)
        if method == "blockhess loss_hvp":
            return lambda: loss_hvp(X, target, params, v)
        op = hessian_operator(X, target, params)
        return lambda: op.matvec(v)
    t, ref = torch(), reference()
    Xt, Tt, Wt = ref.as_problem(X, target, weights, "mse")
    loss = ref.loss_of_flat(Xt, Tt, [w.shape for w in Wt], "mse", _settings.EPS, fused=True)
    flat = ref.flatten(Wt).requires_grad_(True)
    vt = t.from_numpy(v)
    if method == "torch gradient":
        return lambda: t.autograd.grad(loss(flat), flat)[0]

    def hvp():
        (g,) = t.autograd.grad(loss(flat), flat, create_graph=True)
        return t.autograd.grad(g, flat, grad_outputs=vt)[0]

    return hvp


def _seconds(fn, repeat=5):
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


class TimeLossHVP:
    params = (METHODS, HVP_SHAPES, DTYPES)
    param_names = ("method", "shape", "dtype")
    rounds = 1
    repeat = (3, 10, 20.0)
    warmup_time = 0.5
    timeout = 600

    def setup(self, method, shape, dtype):
        self.fn = build(method, shape, dtype)

    def time_loss_hvp(self, method, shape, dtype):
        self.fn()


class RatiosLossHVP:
    """The targets' ratios, each from one process timing both methods back to back (min of 5)."""

    params = (HVP_SHAPES, DTYPES)
    param_names = ("shape", "dtype")
    timeout = 600

    def setup(self, shape, dtype):
        self.ours = build("blockhess loss_hvp", shape, dtype)

    def track_hvp_over_torch_gradient(self, shape, dtype):
        return _seconds(self.ours) / _seconds(build("torch gradient", shape, dtype))

    track_hvp_over_torch_gradient.unit = "t(loss_hvp) / t(torch gradient)"

    def track_torch_hvp_over_hvp(self, shape, dtype):
        return _seconds(build("torch double-backward HVP", shape, dtype)) / _seconds(self.ours)

    track_torch_hvp_over_hvp.unit = "t(torch HVP) / t(loss_hvp)"

    def track_rel_error_vs_torch_hvp(self, shape, dtype):
        ours = np.asarray(self.ours(), dtype=np.float64)
        theirs = build("torch double-backward HVP", shape, dtype)().detach().numpy().astype(np.float64)
        return float(np.abs(ours - theirs).max() / np.abs(theirs).max())

    track_rel_error_vs_torch_hvp.unit = "relative error"


class MemLossHVP:
    """Process peak RSS around one product: O(L d (d + d_ff)) for blockhess, never O(P^2)."""

    params = (["blockhess loss_hvp", "torch double-backward HVP"], HVP_SHAPES, ["float64"])
    param_names = ("method", "shape", "dtype")
    timeout = 600

    def setup(self, method, shape, dtype):
        self.fn = build(method, shape, dtype)

    def peakmem_loss_hvp(self, method, shape, dtype):
        self.fn()
