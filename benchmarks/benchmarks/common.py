"""Shared seeds, sizes, inputs and method implementations for the asv suite and ``benchmarks/report.py``.

Every benchmark is a :class:`Bench`: a list of *methods* (blockhess, PyTorch autograd formulations and
"floors") that all compute the same mathematical object on identical inputs. ``Bench.build(method,
*params)`` prepares the inputs (untimed) and returns a zero-argument callable that does the timed work
and returns its output. It raises ``NotImplementedError`` when the method cannot run: the blockhess API
is missing at this commit, or the size is infeasible for that method (asv then skips the combination;
the report prints "n/a").

Conventions: float64 throughout, 2 threads (OpenMP for blockhess, ``torch.set_num_threads(2)`` for
PyTorch, numpy's BLAS for the GEMM floor). PyTorch is imported lazily so blockhess-only benchmarks
(``peakmem_``) do not pay for it. The PyTorch baselines use the strongest formulation we found
(e.g. ``torch.nn.functional.layer_norm``, which is 2-5x faster under ``jacrev`` than a hand-written LN).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

SEED = 20240611
THREADS = 2
EPS = 0.0  # LayerNorm eps everywhere (the blockhess default)

# Sizes: small enough for torch autograd to finish, large enough to show the scaling.
LN_JACOBIAN_SHAPES = [(16, 64), (64, 128)]  # (L, d)
LN_HESSIAN_SHAPES = [(8, 32), (16, 64)]  # (L, d)
FFN_SHAPES = [(16, 64, 256), (49, 16, 64)]  # (L, d, d_ff)
ATTENTION_SHAPES = [(16, 32, 32), (49, 16, 16)]  # (L, d, d_k)
BLOCK_SHAPES = [(8, 16, 16, 32), (49, 16, 16, 64), (16, 32, 32, 64)]  # (L, d, d_k, d_ff)

# Dense outputs above this many bytes are not attempted (this machine has 24 GiB; torch needs several
# copies of its output).
DENSE_LIMIT_BYTES = 2 * 2**30


# --------------------------------------------------------------------------------------------------
# Helpers


def rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([SEED, *key])


# blockhess and PyTorch share one OpenMP runtime (libgomp), which reads OMP_WAIT_POLICY once, when
# it is first loaded; neither library sets it. The benchmarks load PyTorch first so that PyTorch's
# bundled libgomp is the one both use, as in a PyTorch user's process. The peak-memory child skips this.
TORCH_FIRST = True


def blockhess_api(*names: str):
    """The named blockhess attributes, or NotImplementedError if this commit lacks any of them."""
    if TORCH_FIRST:
        try:
            torch()
        except NotImplementedError:
            pass
    try:
        import blockhess
    except ImportError as err:  # pragma: no cover
        raise NotImplementedError(f"blockhess does not import: {err}") from err
    found = []
    for name in names:
        obj = getattr(blockhess, name, None)
        if obj is None:
            raise NotImplementedError(f"blockhess.{name} is not available at this commit")
        found.append(obj)
    return found[0] if len(found) == 1 else tuple(found)


_torch = None


def torch():
    """PyTorch, imported on first use and limited to THREADS threads."""
    global _torch
    if _torch is None:
        try:
            import torch as _t
        except ImportError as err:
            raise NotImplementedError("PyTorch is not installed") from err
        _t.set_num_threads(THREADS)
        _torch = _t
    return _torch


def as_tensor(a: np.ndarray):
    return torch().from_numpy(np.array(a, dtype=np.float64, copy=True))


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def rel_error(a, b) -> float:
    """||a - b||_F / ||b||_F (b is the autograd reference)."""
    a = np.asarray(to_numpy(a), dtype=np.float64)
    b = np.asarray(to_numpy(b), dtype=np.float64)
    if a.size != b.size:
        raise ValueError(f"cannot compare outputs of shapes {a.shape} and {b.shape}")
    a = a.reshape(b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def floor_zeros(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    """Allocate-and-zero floor: the least work any method returning a fresh array of `shape` does."""

    def run():
        out = np.zeros(shape)
        out.fill(0.0)  # touch every page: np.zeros alone maps lazily-zeroed pages
        return out

    return run


def check_dense(shape: tuple[int, ...], what: str) -> None:
    nbytes = 8 * math.prod(shape)
    if nbytes > DENSE_LIMIT_BYTES:
        raise NotImplementedError(f"{what} would be {nbytes / 2**30:.1f} GiB; skipped on this machine")


# --------------------------------------------------------------------------------------------------
# PyTorch models (from the definitions in spec §1, float64)


def torch_layernorm(x, eps: float = EPS):
    F = torch().nn.functional
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def torch_attention(X, WQ, WK, WV):
    t = torch()
    dk = WQ.shape[1]
    return t.softmax((X @ WQ) @ (X @ WK).T / math.sqrt(dk), dim=-1) @ (X @ WV)


def torch_ffn(Y, W1, W2):
    return torch().relu(Y @ W1) @ W2


def torch_block(X, WQ, WK, WV, W1, W2, eps: float = EPS):
    Y = torch_layernorm(X + torch_attention(X, WQ, WK, WV), eps)
    return torch_layernorm(Y + torch_ffn(Y, W1, W2), eps)


# --------------------------------------------------------------------------------------------------
# Benchmarks


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # human-readable, for the report
    kind: str  # "ours" | "torch" | "floor"
    layout: str  # methods with the same layout produce the same array (up to reshape)
    short: str = ""  # for the chart; defaults to label

    @property
    def chart_label(self) -> str:
        return self.short or self.label


class Bench:
    name = ""
    title = ""
    short = ""  # for the chart
    param_names: tuple[str, ...] = ()
    params: tuple[list, ...] = ()
    methods: tuple[Method, ...] = ()

    def method(self, name: str) -> Method:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.methods]

    def ours(self, layout: str) -> str | None:
        """The blockhess method producing `layout` (the baseline of the ratios)."""
        for m in self.methods:
            if m.kind == "ours" and m.layout == layout:
                return m.name
        return None

    def reference(self, layout: str) -> str | None:
        """The autograd method whose output the blockhess method of `layout` is checked against."""
        for m in self.methods:
            if m.kind == "torch" and m.layout == layout:
                return m.name
        return None

    def build(self, method: str, *params) -> Callable[[], object]:
        if method not in self.method_names:
            raise ValueError(f"{self.name}: unknown method {method!r}")
        return getattr(self, "_" + method)(*params)

    def densify(self, layout: str, out, *params):
        """The dense array a structured output stands for (benches with such layouts override)."""
        raise NotImplementedError(f"{self.name}: no dense form of layout {layout!r}")

    def rel_error(self, method: str, *params) -> float:
        """Relative error of a blockhess method against the autograd reference of the same layout."""
        ref = self.reference(self.method(method).layout)
        if ref is None:
            raise NotImplementedError(f"{self.name}: no autograd reference for {method}")
        return rel_error(self.build(method, *params)(), self.build(ref, *params)())


class LayerNormJacobian(Bench):
    name = "ln_jacobian"
    title = "LayerNorm Jacobian"
    short = "LN Jac"
    param_names = ("shape",)
    params = (LN_JACOBIAN_SHAPES,)
    methods = (
        Method("blockhess_dense", "blockhess dense", "ours", "dense", "dense"),
        Method("blockhess_blocks", "blockhess blocks", "ours", "blocks", "blocks"),
        Method("jacrev_dense", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("vmap_jacrev_blocks", "vmap(jacrev) over rows", "torch", "blocks", "vmap(jacrev)"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor_dense", "floor: allocate+zero dense", "floor", "dense"),
        Method("floor_blocks", "floor: allocate+zero blocks", "floor", "blocks"),
    )

    @staticmethod
    def inputs(shape):
        return rng(1, *shape).standard_normal(shape)

    def _blockhess_dense(self, shape):
        f = blockhess_api("layernorm_jacobian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="dense")

    def _blockhess_blocks(self, shape):
        f = blockhess_api("layernorm_jacobian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="blocks")

    def _jacrev_dense(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        n = X.numel()
        jac = t.func.jacrev(torch_layernorm)
        return lambda: jac(X).reshape(n, n)

    def _vmap_jacrev_blocks(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        jac = t.func.vmap(t.func.jacrev(torch_layernorm))
        return lambda: jac(X)

    def _autograd_jacobian(self, shape):
        if shape != LN_JACOBIAN_SHAPES[0]:
            raise NotImplementedError("autograd.functional.jacobian takes minutes here; small size only")
        t = torch()
        X = as_tensor(self.inputs(shape))
        n = X.numel()
        return lambda: t.autograd.functional.jacobian(torch_layernorm, X).reshape(n, n)

    def _floor_dense(self, shape):
        n = shape[0] * shape[1]
        return floor_zeros((n, n))

    def _floor_blocks(self, shape):
        L, d = shape
        return floor_zeros((L, d, d))


class LayerNormHessian(Bench):
    name = "ln_hessian"
    title = "LayerNorm second derivative"
    short = "LN Hess"
    param_names = ("shape",)
    params = (LN_HESSIAN_SHAPES,)
    methods = (
        Method("blockhess_dense", "blockhess dense", "ours", "dense", "dense"),
        Method("blockhess_blocks", "blockhess blocks", "ours", "blocks", "blocks"),
        Method("hessian_dense", "torch.func.hessian", "torch", "dense", "hessian"),
        Method("vmap_hessian_blocks", "vmap(hessian) over rows", "torch", "blocks", "vmap(hessian)"),
        Method("floor_dense", "floor: allocate+zero dense", "floor", "dense"),
        Method("floor_blocks", "floor: allocate+zero blocks", "floor", "blocks"),
    )

    @staticmethod
    def inputs(shape):
        return rng(2, *shape).standard_normal(shape)

    @staticmethod
    def dense_shape(shape):
        n = shape[0] * shape[1]
        return (n * n, n)

    def _blockhess_dense(self, shape):
        f = blockhess_api("layernorm_hessian")
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="dense")

    def _blockhess_blocks(self, shape):
        f = blockhess_api("layernorm_hessian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="blocks")

    def _hessian_dense(self, shape):
        t = torch()
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        X = as_tensor(self.inputs(shape))
        hess = t.func.hessian(torch_layernorm)
        out_shape = self.dense_shape(shape)
        return lambda: hess(X).reshape(out_shape)

    def _vmap_hessian_blocks(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        hess = t.func.vmap(t.func.hessian(torch_layernorm))
        return lambda: hess(X)

    def _floor_dense(self, shape):
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        return floor_zeros(self.dense_shape(shape))

    def _floor_blocks(self, shape):
        L, d = shape
        return floor_zeros((L, d, d, d))


class WeightJacobian(Bench):
    """Jacobians with respect to one weight matrix; subclasses give inputs, out_shape, _torch_fn."""

    def _jacrev(self, wrt, shape):
        t = torch()
        fn, W = self._torch_fn(wrt, shape)
        jac = t.func.jacrev(fn)
        out = self.out_shape(wrt, shape)
        return lambda: jac(W).reshape(out)

    def _autograd_jacobian(self, wrt, shape):
        t = torch()
        fn, W = self._torch_fn(wrt, shape)
        out = self.out_shape(wrt, shape)
        return lambda: t.autograd.functional.jacobian(fn, W).reshape(out)

    def _floor(self, wrt, shape):
        return floor_zeros(self.out_shape(wrt, shape))


class FFNJacobian(WeightJacobian):
    name = "ffn_jacobian"
    title = "FFN Jacobian"
    short = "FFN Jac"
    param_names = ("wrt", "shape")
    params = (["W_1", "W_2"], FFN_SHAPES)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("blockhess_kron", "blockhess Kronecker factors", "ours", "kron", "kron factors"),
        Method("jacrev", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor", "floor: allocate+zero", "floor", "dense"),
    )

    def _blockhess_kron(self, wrt, shape):
        f = blockhess_api("ffn_jacobian")
        Y, W1, W2 = self.inputs(shape)
        return lambda: f(Y, W1, W2, wrt, layout="kron")

    def densify(self, layout, out, wrt, shape):
        """The Kronecker factors (U, V) rebuild the dense Jacobian."""
        U, V = out
        return np.einsum("tp,tcq->tcpq", U, V).reshape(self.out_shape(wrt, shape))

    def rel_error(self, method, *params):
        if method != "blockhess_kron":
            return super().rel_error(method, *params)
        return rel_error(self.densify("kron", self.build(method, *params)(), *params),
                         self.build("jacrev", *params)())

    @staticmethod
    def inputs(shape):
        L, d, dff = shape
        g = rng(3, *shape)
        Y = g.standard_normal((L, d))
        W1 = g.standard_normal((d, dff)) / math.sqrt(d)
        W2 = g.standard_normal((dff, d)) / math.sqrt(dff)
        return Y, W1, W2

    @staticmethod
    def out_shape(wrt, shape):
        L, d, dff = shape
        return (L * d, d * dff)  # W_1 is (d, d_ff), W_2 is (d_ff, d): same size

    def _blockhess(self, wrt, shape):
        f = blockhess_api("ffn_jacobian")
        Y, W1, W2 = self.inputs(shape)
        return lambda: f(Y, W1, W2, wrt)

    def _torch_fn(self, wrt, shape):
        Y, W1, W2 = (as_tensor(a) for a in self.inputs(shape))
        if wrt == "W_1":
            return (lambda W: torch_ffn(Y, W, W2)), W1
        return (lambda W: torch_ffn(Y, W1, W)), W2


class AttentionJacobian(WeightJacobian):
    name = "attention_jacobian"
    title = "Attention Jacobian"
    short = "Attn Jac"
    param_names = ("wrt", "shape")
    params = (["W_Q", "W_K", "W_V"], ATTENTION_SHAPES)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("jacrev", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor", "floor: allocate+zero", "floor", "dense"),
    )

    @staticmethod
    def inputs(shape):
        L, d, dk = shape
        g = rng(4, *shape)
        X = g.standard_normal((L, d))
        WQ = g.standard_normal((d, dk)) / math.sqrt(d)
        WK = g.standard_normal((d, dk)) / math.sqrt(d)
        WV = g.standard_normal((d, d)) / math.sqrt(d)
        return X, WQ, WK, WV

    @staticmethod
    def out_shape(wrt, shape):
        L, d, dk = shape
        return (L * d, d * (d if wrt == "W_V" else dk))

    def _blockhess(self, wrt, shape):
        f = blockhess_api("attention_jacobian")
        X, WQ, WK, WV = self.inputs(shape)
        return lambda: f(X, WQ, WK, WV, wrt)

    def _torch_fn(self, wrt, shape):
        X, WQ, WK, WV = (as_tensor(a) for a in self.inputs(shape))
        if wrt == "W_Q":
            return (lambda W: torch_attention(X, W, WK, WV)), WQ
        if wrt == "W_K":
            return (lambda W: torch_attention(X, WQ, W, WV)), WK
        return (lambda W: torch_attention(X, WQ, WK, W)), WV


class BlockLossHessian(Bench):
    name = "block_hessian"
    title = "Full block loss Hessian (MSE)"
    short = "Block Hess"
    param_names = ("shape",)
    params = (BLOCK_SHAPES,)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("hessian", "torch.func.hessian", "torch", "dense", "hessian"),
        Method("autograd_hessian", "autograd.functional.hessian(vectorize=True)", "torch", "dense", "autograd.hessian"),
        Method("floor_gemm", "floor: numpy J^T J GEMM", "floor", "dense", "J^T J GEMM floor"),
        Method("floor_zeros", "floor: allocate+zero", "floor", "dense"),
    )

    @staticmethod
    def sizes(shape):
        L, d, dk, dff = shape
        return [d * dk, d * dk, d * d, d * dff, dff * d]

    @classmethod
    def num_params(cls, shape) -> int:
        return sum(cls.sizes(shape))

    @staticmethod
    def inputs(shape):
        L, d, dk, dff = shape
        g = rng(5, *shape)
        X = g.standard_normal((L, d))
        target = g.standard_normal((L, d))
        WQ = g.standard_normal((d, dk)) / math.sqrt(d)
        WK = g.standard_normal((d, dk)) / math.sqrt(d)
        WV = g.standard_normal((d, d)) / math.sqrt(d)
        W1 = g.standard_normal((d, dff)) / math.sqrt(d)
        W2 = g.standard_normal((dff, d)) / math.sqrt(dff)
        return X, target, (WQ, WK, WV, W1, W2)

    def _blockhess(self, shape):
        BlockParams, loss_hessian = blockhess_api("BlockParams", "loss_hessian")
        X, target, W = self.inputs(shape)
        params = BlockParams(*W)
        return lambda: loss_hessian(X, target, params, loss="mse", part="full", layout="dense")

    def _torch_loss(self, shape):
        X, target, W = self.inputs(shape)
        X, target = as_tensor(X), as_tensor(target)
        shapes = [w.shape for w in W]
        sizes = self.sizes(shape)
        w0 = as_tensor(np.concatenate([w.reshape(-1) for w in W]))

        def loss(w):
            mats = [p.reshape(s) for p, s in zip(w.split(sizes), shapes)]
            Z = torch_block(X, *mats)
            return ((Z - target) ** 2).mean()

        return loss, w0

    def _hessian(self, shape):
        t = torch()
        loss, w0 = self._torch_loss(shape)
        hess = t.func.hessian(loss)
        return lambda: hess(w0)

    def _autograd_hessian(self, shape):
        t = torch()
        loss, w0 = self._torch_loss(shape)
        return lambda: t.autograd.functional.hessian(loss, w0, vectorize=True)

    def _floor_gemm(self, shape):
        L, d = shape[:2]
        J = rng(6, *shape).standard_normal((L * d, self.num_params(shape)))
        return lambda: J.T @ J

    def _floor_zeros(self, shape):
        P = self.num_params(shape)
        return floor_zeros((P, P))


LN_JACOBIAN = LayerNormJacobian()
LN_HESSIAN = LayerNormHessian()
FFN_JACOBIAN = FFNJacobian()
ATTENTION_JACOBIAN = AttentionJacobian()
BLOCK_HESSIAN = BlockLossHessian()
BENCHES = {b.name: b for b in (LN_JACOBIAN, LN_HESSIAN, FFN_JACOBIAN, ATTENTION_JACOBIAN, BLOCK_HESSIAN)}


# --------------------------------------------------------------------------------------------------
# Peak memory of one call, measured in a fresh process (no PyTorch, no other benchmark's garbage)

_PEAK_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import common
common.TORCH_FIRST = False
args = json.loads(sys.argv[2])
params = [tuple(p) if isinstance(p, list) else p for p in args["params"]]
fn = common.BENCHES[args["bench"]].build(args["method"], *params)   # inputs prepared, untimed

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
except OSError:
    base = status("VmHWM")
out = fn()
peak = status("VmHWM")
print(json.dumps({"base": base, "peak": peak, "nbytes": int(common.to_numpy(out).nbytes)}))
"""


def peak_memory(bench: str, method: str, *params) -> dict:
    """Run one call in a subprocess; returns base RSS, peak RSS and the output's size in bytes."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/status"):
        raise NotImplementedError("peak memory needs /proc (Linux)")
    BENCHES[bench].build(method, *params)  # NotImplementedError here rather than in the child
    here = os.path.dirname(os.path.abspath(__file__))
    arg = json.dumps({"bench": bench, "method": method, "params": [list(p) if isinstance(p, tuple) else p for p in params]})
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, here, arg], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])
