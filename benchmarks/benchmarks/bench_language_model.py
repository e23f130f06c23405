"""A GPT-2-small language model, whole (transformers' GPT2LMHeadModel with random weights, no
download: vocabulary 50,257, 12 blocks of d = 768, 12 heads, d_ff = 3072, ln_f, the LM head tied to
wte; P = 124 million), imported with ``blockhess.from_torch``: its next-token loss at L = 128 tokens,
B = 1, float32, 2 threads.

- ``loss_hvp`` against a torch gradient and torch's double-backward HVP of the same loss (the
  module's own, eager attention): targets <= 2.5x the gradient and >= 1.3x faster than the HVP; a
  product of a cached ``hessian_operator`` against the gradient (target <= 2x);
- the peak memory of one product, each in a fresh process, blockhess against torch's HVP;
- the top eigenvalue of the Hessian, ``eigsh(k=1, tol=1e-3)`` under the default memory budget
  (target: under 10 minutes).
The ``track_`` benchmarks report the ratios, each measured one method right after the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import timeit

import numpy as np

from . import _settings
from ._harness import blockhess_api
from ._torch_methods import torch

L = 128

# Builds the model (float32, seeded), imports it, and prepares one product's inputs; shared by the
# ratios and the peak-memory child (which runs it as a script: no benchmark package there).
_BUILD = r"""
import numpy as np, torch, transformers, blockhess


def build(threads, seed, L):
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    config = transformers.GPT2Config(attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    spec, params = blockhess.from_torch(model)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(1, L))
    v = rng.standard_normal(params.size).astype(np.float32)
    return model, params, ids, v


def torch_loss(model, ids):
    t = torch.as_tensor(ids)
    return model(input_ids=t, labels=t).loss


def torch_hvp(model, ids, vs):
    ps = list(model.parameters())
    g = torch.autograd.grad(torch_loss(model, ids), ps, create_graph=True)
    return torch.autograd.grad(g, ps, grad_outputs=vs)
"""

_PEAK = _BUILD + r"""
import json, sys


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


method, threads, seed, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, params, ids, v = build(threads, seed, L)
vs = [torch.randn_like(p) for p in model.parameters()]
with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here on
    f.write("5")
base = status("VmRSS")
if method == "blockhess":
    blockhess.loss_hvp(ids, ids, params, v, loss="next_token")
else:
    torch_hvp(model, ids, vs)
print(json.dumps({"peak": status("VmHWM") - base}))
"""


def _namespace():
    ModelSpec = blockhess_api("ModelSpec")
    if "vocab_size" not in getattr(ModelSpec, "__dataclass_fields__", {}):
        raise NotImplementedError("blockhess has no language models at this commit")
    torch()
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise NotImplementedError("transformers is not installed") from err
    namespace = {}
    exec(compile(_BUILD, "bench_language_model._BUILD", "exec"), namespace)
    return namespace


def _seconds(fn, repeat=3):
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


class RatiosGPT2SmallLM:
    timeout = 1800

    def setup_cache(self):
        ns = _namespace()
        model, params, ids, v = ns["build"](_settings.THREADS, _settings.SEED, L)
        loss_hvp, hessian_operator = blockhess_api("loss_hvp", "hessian_operator")
        t = torch()
        ps = list(model.parameters())
        vs = [t.randn_like(p) for p in ps]
        ours = _seconds(lambda: loss_hvp(ids, ids, params, v, loss="next_token"))
        gradient = _seconds(lambda: t.autograd.grad(ns["torch_loss"](model, ids), ps))
        torch_hvp = _seconds(lambda: ns["torch_hvp"](model, ids, vs))
        op = hessian_operator(ids, ids, params, loss="next_token")
        product = _seconds(lambda: op @ v)
        return {"hvp_over_gradient": ours / gradient, "torch_hvp_over_hvp": torch_hvp / ours,
                "product_over_gradient": product / gradient}

    def track_hvp_over_torch_gradient(self, ratios):
        return ratios["hvp_over_gradient"]

    def track_torch_hvp_over_hvp(self, ratios):
        return ratios["torch_hvp_over_hvp"]

    def track_operator_product_over_torch_gradient(self, ratios):
        return ratios["product_over_gradient"]

    track_hvp_over_torch_gradient.unit = "ratio"
    track_torch_hvp_over_hvp.unit = "ratio"
    track_operator_product_over_torch_gradient.unit = "ratio"


class PeakMemoryGPT2SmallLM:
    """Peak memory (MB above the built model, its import and the vector) of one HVP, each in a fresh process."""

    timeout = 1200
    params = (["blockhess", "torch"],)
    param_names = ("method",)

    def setup(self, method):
        _namespace()
        if not os.path.exists("/proc/self/clear_refs"):
            raise NotImplementedError("peak memory needs /proc (Linux)")

    def track_peak_mb(self, method):
        done = subprocess.run([sys.executable, "-c", _PEAK, method, str(_settings.THREADS), str(_settings.SEED), str(L)],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])["peak"] / 1e6

    track_peak_mb.unit = "MB"


class TimeGPT2SmallTopEigenvalue:
    timeout = 1800

    def setup_cache(self):
        ns = _namespace()
        _, params, ids, _ = ns["build"](_settings.THREADS, _settings.SEED, L)
        hessian_operator = blockhess_api("hessian_operator")
        start = time.perf_counter()
        hessian_operator(ids, ids, params, loss="next_token").eigsh(k=1, tol=1e-3, return_eigenvectors=False)
        return time.perf_counter() - start

    def track_top_eigenvalue_seconds(self, seconds):
        return seconds

    track_top_eigenvalue_seconds.unit = "seconds"
