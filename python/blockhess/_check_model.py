"""``blockhess check --model``: a whole model's exact Hessian-vector products, imported with
:func:`blockhess.from_torch`, checked against the module itself.

The model is an ``nn.Module`` saved with ``torch.save`` (a file), or a Hugging Face GPT-2
configuration by name, built with random weights (no download). blockhess's ``loss_hvp`` of the
imported model is compared, for random directions u over the module's own parameters, with

- reverse over reverse: ``torch.autograd.grad`` twice through the module's own forward (float64
  copies of its parameters), the reference that decides the check;
- central finite differences of blockhess's exact gradient along u;
- forward over reverse as ``torch.func.hessian`` forms it (``torch.func.jvp`` of ``torch.func.jacrev``),
  reported, not decisive: in torch 2.13 it is wrong for ``layer_norm`` with a weight in the (weight,
  upstream) cross terms (docs/errata.md's appendix), which shows up in the parameters below a norm.

Each vector over the module's parameters is laid out as blockhess's by the importer's own reader.
The loss is the model's: next-token for a language model (its definition in float64: Hugging Face's
own casts the logits to float32), the class token's cross-entropy for a ViT classifier, else the
mean squared error against a random target.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._check_comparison import TOLERANCE
from ._check_references import FD_STEP
from ._command_files import load_module
from ._command_line import UsageError

# transformers' GPT-2 configurations by name (their published shapes), built with random weights.
GPT2_CONFIGS = {
    "gpt2-tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
}


@dataclass
class ParameterError:
    name: str
    against_autograd: float  # relative, this parameter's rows of H u
    against_forward_over_reverse: float


@dataclass
class ModelReport:
    model: str
    spec: str
    P: int
    tokens: int
    batch: int
    loss: str
    vectors: int
    against_autograd: float  # the worst relative error over the vectors
    against_finite_differences: float
    forward_over_reverse_against_autograd: float  # torch against itself: its forward-over-reverse bug
    seconds_blockhess: float
    seconds_autograd: float
    parameters: list[ParameterError] = field(default_factory=list)
    ok: bool = False


def load_model(source: str, seed: int) -> Any:
    """The nn.Module in the file ``source`` (torch.load: the file runs code as it loads, so load only
    files you trust), or a GPT-2 configuration by name with random weights."""
    import torch

    if os.path.exists(source):
        try:
            return load_module(source, "--model")
        except ValueError as err:
            raise UsageError(str(err)) from None
    if source not in GPT2_CONFIGS:
        raise UsageError(f"--model {source}: no such file, and not a configuration name "
                         f"({', '.join(GPT2_CONFIGS)})")
    try:
        import transformers
    except ImportError:
        raise UsageError(f"--model {source} needs transformers (pip install transformers)") from None
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**GPT2_CONFIGS[source], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def check_model(module: Any, name: str, L: int, batch: int, vectors: int, seed: int, progress: Any) -> ModelReport:
    """blockhess's H u of the imported module against the module's own, along ``vectors`` random
    directions u (float64 copies; the caller's module stays as it was)."""
    import torch

    from .from_torch import _importer, _norm_eps, from_torch
    from .hvp import loss_hvp

    module = copy.deepcopy(module).double().eval()
    read, run = _importer(module)
    spec, params = from_torch(module)
    eps = _norm_eps(read(module, torch.float64)[2], torch.float64)
    rng = np.random.default_rng(seed)
    X, target, loss = _inputs(spec, params, L, batch, rng)
    progress.start(3 * vectors + 2, f"{name}: P = {params.size}")
    reference = _ModuleProducts(module, read, run, spec, X, target, loss)
    progress.advance()
    slices = params.slices()
    worst = {"autograd": 0.0, "fd": 0.0, "fwd": 0.0}
    per_parameter = {n: [0.0, 0.0] for n in params.names}
    seconds = 0.0  # blockhess's products
    for _ in range(vectors):
        u = rng.standard_normal(reference.size)
        reverse = reference.reverse_over_reverse(u)
        forward = reference.forward_over_reverse(u)
        progress.advance()
        v = reference.laid_out(u)
        started = time.perf_counter()
        ours = loss_hvp(X, target, params, v, loss=loss, eps=eps)
        seconds += time.perf_counter() - started
        progress.advance()
        fd = _finite_differences(X, target, params, v, loss, eps)
        progress.advance()
        worst["autograd"] = max(worst["autograd"], _relative(ours, reverse))
        worst["fd"] = max(worst["fd"], _relative(ours, fd))
        worst["fwd"] = max(worst["fwd"], _relative(forward, reverse))
        # A parameter's rows against their own norm, floored at a millionth of the whole product's
        # (b_K's rows are exactly zero in closed form, rounding noise in autograd).
        floor = 1e-6 * float(np.linalg.norm(reverse))
        for n, sl in slices.items():
            errors = per_parameter[n]
            errors[0] = max(errors[0], _relative(ours[sl], reverse[sl], floor))
            errors[1] = max(errors[1], _relative(forward[sl], reverse[sl], floor))
    report = ModelReport(name, repr(spec), params.size, spec.tokens(X.shape[1]), batch, loss, vectors, worst["autograd"],
                         worst["fd"], worst["fwd"], seconds / vectors, reference.seconds / vectors,
                         [ParameterError(n, e[0], e[1]) for n, e in per_parameter.items()])
    report.ok = (report.against_autograd <= TOLERANCE[("torch", "float64")]
                 and report.against_finite_differences <= TOLERANCE[("finite-differences", "float64")])
    progress.advance()
    return report


def _inputs(spec: Any, params: Any, L: int, batch: int, rng: np.random.Generator) -> tuple[Any, Any, str]:
    """(X, target, loss): the model's input (token ids, a ViT's patches, or X), and its own loss."""
    if spec.class_token:  # a ViT: as many patches as its positions take (its image size); --L does not apply
        L = spec.n_positions - 1
        X = rng.standard_normal((batch, L, spec.patch_dim))
    elif spec.reads_tokens:
        if spec.n_positions and L > spec.n_positions:
            raise UsageError(f"--L {L}: the model has {spec.n_positions} positions")
        X = rng.integers(0, spec.vocab_size, size=(batch, L))
    else:
        X = rng.standard_normal((batch, L, params.d))
    if spec.lm_head:
        return X, X.copy(), "next_token"
    if spec.classes:
        return X, rng.integers(0, spec.classes, size=batch), "pooled_cross_entropy"
    return X, rng.standard_normal((batch, spec.tokens(L), params.d)), "mse"


class _ModuleProducts:
    """The module's own Hessian-vector products of its loss, over its flat parameters, laid out as
    blockhess's by the importer's reader (``read`` on a copy holding the vector)."""

    def __init__(self, module: Any, read: Any, run: Any, spec: Any, X: Any, target: Any, loss: str) -> None:
        import torch

        from ._torch_reference import loss as reference_loss

        self._torch, self._module, self._read, self._spec = torch, module, read, spec
        names = [n for n, _ in module.named_parameters()]
        self._shapes = [p.shape for p in module.parameters()]
        self._sizes = [s.numel() for s in self._shapes]
        self._flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        self.size = self._flat.numel()
        self.seconds = 0.0
        X_t, target_t = torch.as_tensor(X), torch.as_tensor(target)

        def module_loss(v):
            tensors = dict(zip(names, (t.reshape(s) for t, s in zip(v.split(self._sizes), self._shapes))))
            out = run(lambda *a, **k: torch.func.functional_call(module, tensors, a, k), module, X_t)
            if loss == "next_token":
                return reference_loss(out, target_t, loss)
            if loss == "pooled_cross_entropy":  # the module's output: its class token's logits
                return torch.nn.functional.cross_entropy(out, target_t)
            return ((out - target_t) ** 2).mean()

        self._loss = module_loss
        self._holder = copy.deepcopy(module)
        self._x = self._flat.clone().requires_grad_(True)
        with self._math_attention():
            (self._gradient,) = torch.autograd.grad(module_loss(self._x), self._x, create_graph=True)

    def _math_attention(self):  # the fused attention kernels have no second derivative
        return self._torch.nn.attention.sdpa_kernel(self._torch.nn.attention.SDPBackend.MATH)

    def reverse_over_reverse(self, u: np.ndarray) -> np.ndarray:
        """The reference; its seconds (the product alone) add up in ``seconds``."""
        started = time.perf_counter()
        with self._math_attention():
            (hu,) = self._torch.autograd.grad(self._gradient, self._x, grad_outputs=self._torch.as_tensor(u),
                                              retain_graph=True)
        self.seconds += time.perf_counter() - started
        return self.laid_out(hu)

    def forward_over_reverse(self, u: np.ndarray) -> np.ndarray:
        """As torch.func.hessian forms it: the jvp of jacrev."""
        with self._math_attention():
            hu = self._torch.func.jvp(self._torch.func.jacrev(self._loss), (self._flat,), (self._torch.as_tensor(u),))[1]
        return self.laid_out(hu)

    def laid_out(self, u: Any) -> np.ndarray:
        """A vector over the module's parameters in blockhess's order."""
        from .block import BlockParams

        with self._torch.no_grad():
            for p, piece in zip(self._holder.parameters(), self._torch.as_tensor(u).split(self._sizes)):
                p.copy_(piece.reshape(p.shape))
        return np.asarray(BlockParams.from_arrays(self._spec, self._read(self._holder, self._torch.float64)[1]).flatten())


def _finite_differences(X: Any, target: Any, params: Any, v: np.ndarray, loss: str, eps: float) -> np.ndarray:
    """Central differences of blockhess's exact gradient along v."""
    from .block import BlockParams, loss_gradient

    h = FD_STEP["float64"] / max(1.0, float(np.abs(v).max()))
    w = np.asarray(params.flatten())
    plus, minus = (BlockParams.unflatten(w + s * h * v, params) for s in (1, -1))
    return (loss_gradient(X, target, plus, loss=loss, eps=eps) - loss_gradient(X, target, minus, loss=loss, eps=eps)) / (2 * h)


def _relative(a: Any, b: Any, floor: float = 1e-300) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), floor, 1e-300))


def format_model_report(r: ModelReport) -> str:
    tol, fd_tol = TOLERANCE[("torch", "float64")], TOLERANCE[("finite-differences", "float64")]
    mark = lambda error, limit: "ok" if error <= limit else "FAIL"  # noqa: E731
    lines = [
        f"blockhess check --model {r.model}: {r.spec}",
        f"  P = {r.P:,} parameters, {r.batch} x {r.tokens} tokens, loss {r.loss}, {r.vectors} random directions, float64",
        f"  H u against reverse-over-reverse autograd of the module: {r.against_autograd:.2e} "
        f"(tolerance {tol:.0e}) {mark(r.against_autograd, tol)}",
        f"  H u against finite differences of the exact gradient:     {r.against_finite_differences:.2e} "
        f"(tolerance {fd_tol:.0e}) {mark(r.against_finite_differences, fd_tol)}",
        f"  one product: blockhess {r.seconds_blockhess:.3g} s, torch reverse-over-reverse {r.seconds_autograd:.3g} s",
    ]
    wrong = [p for p in r.parameters if p.against_autograd > tol]
    if wrong:
        lines.append("  parameters where blockhess disagrees with autograd: "
                     + ", ".join(f"{p.name} ({p.against_autograd:.1e})" for p in wrong))
    torch_wrong = [p for p in r.parameters if p.against_forward_over_reverse > tol]
    if torch_wrong:
        lines.append(f"  torch.func forward-over-reverse (jvp of jacrev, as torch.func.hessian) disagrees with reverse-over-reverse by "
                     f"{r.forward_over_reverse_against_autograd:.2e}, in "
                     + ", ".join(f"{p.name} ({p.against_forward_over_reverse:.1e})" for p in torch_wrong[:8])
                     + (f" and {len(torch_wrong) - 8} more" if len(torch_wrong) > 8 else "")
                     + ": torch's own error (layer_norm with a weight under forward-mode AD in torch 2.13; "
                     "docs/errata.md), not blockhess's")
    lines.append("verified" if r.ok else "FAILED")
    return "\n".join(lines)
