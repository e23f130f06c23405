"""``blockhess check``: compute a block's loss Hessian in closed form, verify it, show what it found.

The verification is independent of blockhess's formulas: ``torch.func.hessian`` of the same block
written in PyTorch (float64) when torch is installed, else central finite differences of the exact
closed-form gradient.

Every bad option or combination is refused before any computation (:func:`validate`), as one line
``blockhess check: error: ...`` on stderr and exit status 2; so is an error that blockhess raises
about the data during the run. Exit status 1 means that the check ran and an error exceeded its
tolerance, 0 that it passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import _command_files
from ._config import format_bytes
from .block import BlockParams, _parameter_table, loss_gradient, loss_hessian, loss_value
from .hvp import hessian_operator
from .spec import ACTIVATIONS, BlockSpec

# Relative Frobenius error allowed against each reference, by dtype.
TOLERANCE = {
    ("torch", "float64"): 1e-10,
    ("torch", "float32"): 1e-4,
    ("finite-differences", "float64"): 1e-5,
    ("finite-differences", "float32"): 1e-2,
}

# Relative tolerance of outer + functional == full (both parts come from the same closed form).
SPLIT_TOLERANCE = {"float64": 1e-12, "float32": 1e-4}
# Relative tolerance of the matrix-free product H V against the dense H times V (one closed form
# against another, both in the check's dtype).
HVP_TOLERANCE = {"float64": 1e-12, "float32": 1e-4}
HVP_VECTORS = 4

# The absolute floor of every comparison: error <= tolerance * max(||reference||_F, floor), with
# tolerance * floor = NOISE_MULTIPLE * the problem's rounding-noise scale (_rounding_noise).
# When the true Hessian is exactly zero (d=1 with eps > 0, where LayerNorm returns 0, or d=2 with
# eps=0, where it maps every row to +-1: either way the block's output does not depend on the
# weights), the closed form and the reference are both pure rounding noise, and a relative error
# is noise divided by noise. That noise is of order
#     machine epsilon x sqrt(P) x max(|loss|, 1) x max(1, 1/sigma_min)^2
# (terms of the size of the loss, sqrt(P) of them in a Frobenius norm, that cancel exactly,
# amplified by LayerNorm's second derivative, 1/sigma^2 for the smallest row standard deviation
# sigma_min of either LayerNorm's input; finite differences add their rounded gradients divided by
# the step). Measured over 40 seeds and many sizes (L 5..300, d_k, d_ff, batch, both losses,
# float32 and float64, d = 2 and normal d = 4..16), ||H - H_ref||_F stayed below 0.3 of that
# scale, degenerate or not, so 3 leaves a margin of 10. On a normal problem the floor stays below
# tolerance x ||H_ref||_F (float64: about 1000 times below; float32: 1.2-6 times), so the relative
# tolerance decides, and a real error, even 1e-3 relative, still fails.
NOISE_MULTIPLE = 3.0

# Steps of the finite-difference reference, by dtype.
FD_STEP = {"float64": 1e-5, "float32": 1e-2}

# The largest --seed: numpy's legacy seeding and scikit-learn's random_state (the report's experiments)
# take seeds up to 2**32 - 1; every command takes the same range.
MAX_SEED = 2**32 - 1

_TORCH_OVERHEAD = 256 * 2**20  # the torch runtime itself, counted against the machine only (see _memory_needs)


@dataclass
class Config:
    L: int = 49
    d: int = 16
    d_k: int = 16
    d_ff: int = 64
    batch: int = 1
    loss: str = "mse"
    dtype: str = "float64"
    seed: int = 0
    eps: float = 0.0
    device: str = "cpu"
    reference: str = "auto"
    # The block (BlockSpec; the defaults are the paper's block) and a pooled head's classes.
    norm_position: str = "post"
    norm: str = "layernorm"
    affine: bool = False
    bias: bool = False
    heads: int = 1
    out_proj: bool = False
    activation: str = "relu"
    causal: bool = False
    attention_only: bool = False
    classes: int = 10

    @property
    def spec(self) -> BlockSpec:
        """The block (eps is passed to every call, so the spec keeps the default)."""
        return BlockSpec(norm_position=self.norm_position, norm=self.norm, norm_affine=self.affine, bias=self.bias,
                         heads=self.heads, out_proj=self.out_proj, activation=self.activation, causal=self.causal,
                         attention_only=self.attention_only)

    @property
    def pooled(self) -> bool:
        return self.loss == "pooled_cross_entropy"

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """[(name, shape)] of the block's parameters in the canonical order (d_k per head; d_v =
        d / heads)."""
        return _parameter_table(self.spec, self.d, self.d_k, max(1, self.d // self.heads), self.d_ff)

    def describe(self) -> str:
        """The block in words: "post-LN Transformer block" for the paper's, its options otherwise."""
        spec = self.spec
        name = (f"{spec.norm_position}-{'LN' if spec.norm == 'layernorm' else 'RMSNorm'} Transformer block"
                if not spec.attention_only else "self-attention layer")
        options = [f"{spec.heads} heads" if spec.heads > 1 else "",
                   "affine norms" if spec.norm_affine else "", "biases" if spec.bias else "",
                   "W_O" if spec.out_proj else "", spec.activation if spec.activation != "relu" else "",
                   "causal" if spec.causal else ""]
        options = [o for o in options if o]
        return name + (f" ({', '.join(options)})" if options else "")


@dataclass
class BlockReport:
    block: str
    shape: tuple[int, int]
    spectral_norm: float
    outer_fro: float
    functional_fro: float
    # ||block - reference block||_F / max(||reference block||_F, 1e-4 ||H_ref||_F); None where
    # that denominator is itself rounding noise (the block is then held to the absolute floor).
    rel_error: float | None
    abs_error: float = 0.0
    ok: bool = True


@dataclass
class Report:
    config: Config
    P: int
    reference: str
    tolerance: float
    loss_value: float
    # ||H - H_ref||_F / ||H_ref||_F; None when ||H_ref||_F is rounding noise (a zero Hessian).
    rel_error: float | None
    max_asymmetry: float
    # ||outer + functional - full||_F / ||full||_F; None when ||full||_F is rounding noise.
    split_error: float | None
    time_closed_form_s: float
    time_reference_s: float
    speedup: float
    blocks: list[BlockReport] = field(default_factory=list)
    ok: bool = False
    abs_error: float = 0.0  # ||H - H_ref||_F
    reference_norm: float = 0.0  # ||H_ref||_F
    # The pass criterion is abs_error <= tolerance * max(reference_norm, error_floor).
    error_floor: float = 0.0
    # The matrix-free product (hessian_operator) on HVP_VECTORS random vectors against the dense H:
    # ||H V - dense H V||_F / ||dense H V||_F (None where that norm is rounding noise, or on the
    # GPU, where the operator does not run yet), and the time of one product.
    hvp_rel_error: float | None = None
    time_hvp_s: float | None = None
    hvp_ok: bool = True


class UsageError(Exception):
    """A bad option or combination: reported as one line and exit status 2, before any computation."""


# ---------------------------------------------------------------------------------------------
# The problem and the references


def make_problem(cfg: Config):
    """Seeded input, target, parameters (in the spec's canonical order: weights scaled by
    1/sqrt(fan-in), as at initialisation; gamma 1 + N(0, 0.1^2), betas and biases N(0, 0.1^2)) and,
    for loss="pooled_cross_entropy", the classifier head (W_C (d, classes), b_C); else None."""
    rng = np.random.default_rng(cfg.seed)
    lead = (cfg.L,) if cfg.batch == 1 else (cfg.batch, cfg.L)
    X = rng.standard_normal((*lead, cfg.d))
    weights = []
    for name, shape in cfg.parameters():
        if len(shape) == 2:
            weights.append(rng.standard_normal(shape) / math.sqrt(shape[0]))
        else:
            weights.append((1.0 if name.startswith("gamma") else 0.0) + 0.1 * rng.standard_normal(shape))
    head = None
    if cfg.loss == "mse":
        target = rng.standard_normal((*lead, cfg.d))
    elif cfg.pooled:
        target = rng.integers(0, cfg.classes, size=lead[:-1])
        head = (rng.standard_normal((cfg.d, cfg.classes)) / math.sqrt(cfg.d), 0.1 * rng.standard_normal(cfg.classes))
    else:
        target = rng.integers(0, cfg.d, size=lead)
    dtype = np.dtype(cfg.dtype)
    X = X.astype(dtype)
    weights = [w.astype(dtype) for w in weights]
    if cfg.loss == "mse":
        target = target.astype(dtype)
    if head is not None:
        head = tuple(a.astype(dtype) for a in head)
    return X, target, weights, head


def _params(weights, cfg: Config) -> BlockParams:
    return BlockParams.from_arrays(cfg.spec, {name: w for (name, _), w in zip(cfg.parameters(), weights)})


def _torch_reference(X, target, weights, cfg: Config, progress=None, head=None):
    """torch.func.hessian of the loss of the block written directly in PyTorch, float64 (the
    paper's block as the paper writes it; any other spec from the family's definition)."""
    import torch

    from . import _torch_reference as reference

    X, target, weights = reference.as_problem(X, target, weights, cfg.loss, dtype=torch.float64)
    shapes = [tuple(w.shape) for w in weights]
    if head is not None:
        head = tuple(torch.as_tensor(a, dtype=torch.float64) for a in head)
    if cfg.spec.is_paper_block:
        loss_of = reference.loss_of_flat(X, target, shapes, cfg.loss, cfg.eps, head=head)
    else:
        names = [name for name, _ in cfg.parameters()]
        output_of = reference.family_of_flat(X, cfg.spec, names, shapes, cfg.eps)
        loss_of = lambda v: reference.loss(output_of(v), target, cfg.loss, head)  # noqa: E731
    v0 = reference.flatten(weights)
    hess = torch.func.hessian(loss_of)
    hess(v0)  # warm-up
    if progress:
        progress.advance()
    t0 = time.perf_counter()
    H = hess(v0)
    elapsed = time.perf_counter() - t0
    if progress:
        progress.advance()
    return H.numpy(), elapsed


def _finite_difference_reference(X, target, params: BlockParams, cfg: Config, progress=None, head=None):
    """Central differences of the exact gradient, one parameter at a time."""
    v0 = np.asarray(params.flatten(), dtype=np.float64)
    P = v0.size
    h = FD_STEP[cfg.dtype]
    cols = np.empty((P, P))
    t0 = time.perf_counter()
    for k in range(P):
        e = np.zeros(P)
        e[k] = h
        plus = BlockParams.unflatten((v0 + e).astype(cfg.dtype), params)
        minus = BlockParams.unflatten((v0 - e).astype(cfg.dtype), params)
        g_plus = loss_gradient(X, target, plus, loss=cfg.loss, eps=cfg.eps, head=head)
        g_minus = loss_gradient(X, target, minus, loss=cfg.loss, eps=cfg.eps, head=head)
        cols[:, k] = (g_plus - g_minus) / (2 * h)
        if progress:
            progress.advance()
    _symmetrise_in_place(cols)
    return cols, time.perf_counter() - t0


def _symmetrise_in_place(A: np.ndarray, tile: int = 512) -> None:
    """A <- (A + A^T) / 2 tile by tile, without a second (P, P) array."""
    n = A.shape[0]
    for i in range(0, n, tile):
        for j in range(i, n, tile):
            upper = A[i:i + tile, j:j + tile]
            mean = 0.5 * (upper + A[j:j + tile, i:i + tile].T)
            A[i:i + tile, j:j + tile] = mean
            A[j:j + tile, i:i + tile] = mean.T


def _resolve_reference(name: str) -> str:
    """"auto": torch when it can be imported, else finite differences."""
    if name != "auto":
        return name
    try:
        import torch  # noqa: F401
    except ImportError:
        return "finite-differences"
    return "torch"


def _to_device(arrays, device):
    if device == "cpu":
        return arrays
    import cupy

    return [cupy.asarray(a) for a in arrays]


def _to_host(a):
    return a.get() if hasattr(a, "__cuda_array_interface__") else np.asarray(a)


# ---------------------------------------------------------------------------------------------
# Comparisons that survive a zero Hessian


def _smallest_layernorm_sigma(X, weights, cfg: Config) -> float:
    """The smallest row standard deviation (with eps) of the inputs of both LayerNorms, in float64,
    for the paper's block. Other specs use 1: their floor is then sqrt(P) |loss| machine-epsilon,
    far below the relative tolerance of a normal problem; the degenerate sizes that the floor
    exists for were measured on the paper's block."""
    if not cfg.spec.is_paper_block:
        return 1.0
    X = np.asarray(X, dtype=np.float64)
    WQ, WK, WV, W1, W2 = (np.asarray(w, dtype=np.float64) for w in weights)
    T = X @ WQ @ (X @ WK).swapaxes(-1, -2) / math.sqrt(cfg.d_k)
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    S1 = X + A @ X @ WV
    sigma1 = np.sqrt(S1.var(-1) + cfg.eps)
    Y = (S1 - S1.mean(-1, keepdims=True)) / np.where(sigma1 > 0, sigma1, 1.0)[..., None]
    S2 = np.maximum(Y @ W1, 0.0) @ W2 + Y
    sigma2 = np.sqrt(S2.var(-1) + cfg.eps)
    return float(min(sigma1.min(), sigma2.min()))


def _rounding_noise(P: int, loss: float, sigma_min: float, dtype: str, reference: str) -> float:
    """The rounding-noise scale of a comparison (see NOISE_MULTIPLE): sqrt(P) |loss| times the
    relative rounding error of each side. The closed form's, in its dtype (torch's float64 is
    finer), is amplified by LayerNorm's second derivative, a^2 with a = 1/sigma_min; finite
    differences divide rounded gradients, amplified by LayerNorm's first derivative (a), by the step."""
    a = 1.0 / sigma_min if sigma_min > 0 else math.inf
    a = max(a, 1.0)
    unit = float(np.finfo(np.dtype(dtype)).eps)
    relative = unit * a * a
    if reference == "finite-differences":
        relative += unit / FD_STEP[dtype] * a
    return math.sqrt(P) * max(abs(loss), 1.0) * relative


def _fro(a: np.ndarray, rows: int = 1024) -> float:
    """||a||_F, accumulated over row chunks in float64 (no float32 overflow, no large temporary)."""
    total = 0.0
    for i in range(0, a.shape[0], rows):
        chunk = np.asarray(a[i:i + rows], dtype=np.float64)
        total += float(np.vdot(chunk, chunk).real)
    return math.sqrt(total)


def _fro_of_difference(a: np.ndarray, b: np.ndarray, rows: int = 1024) -> float:
    """||a - b||_F in float64, over row chunks (no (P, P) temporary)."""
    total = 0.0
    for i in range(0, a.shape[0], rows):
        diff = np.asarray(a[i:i + rows], dtype=np.float64) - np.asarray(b[i:i + rows], dtype=np.float64)
        total += float(np.vdot(diff, diff).real)
    return math.sqrt(total)


def _fro_of_split_residual(outer, functional, full, rows: int = 1024) -> float:
    """||outer + functional - full||_F over row chunks."""
    total = 0.0
    for i in range(0, full.shape[0], rows):
        r = (np.asarray(outer[i:i + rows], dtype=np.float64) + functional[i:i + rows]) - full[i:i + rows]
        total += float(np.vdot(r, r).real)
    return math.sqrt(total)


def _max_asymmetry(a: np.ndarray, rows: int = 1024) -> float:
    """max |a - a^T| over row chunks."""
    worst = 0.0
    for i in range(0, a.shape[0], rows):
        part = a[i:i + rows]
        if part.size:
            worst = max(worst, float(np.abs(part - a[:, i:i + rows].T).max()))
    return worst


def _spectral_norm(blk: np.ndarray) -> float:
    """||blk||_2: the eigenvalues of an exactly symmetric block (about 4x faster), else the SVD."""
    if blk.size == 0:
        return 0.0
    blk = np.asarray(blk, dtype=np.float64)
    if blk.shape[0] == blk.shape[1] and np.array_equal(blk, blk.T):
        return float(np.abs(np.linalg.eigvalsh(blk)).max())
    return float(np.linalg.svd(blk, compute_uv=False)[0])


# ---------------------------------------------------------------------------------------------
# Progress


class _Progress:
    """One progress bar over the whole run, on stderr and only when stderr is a terminal.

    tqdm is imported only when a bar is shown; without it, a line per phase instead. Disabled, it
    prints nothing at all."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._lines = False  # tqdm missing: one line per phase

    def start(self, total: int, description: str = "") -> None:
        if not self.enabled or self._bar is not None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._lines = True
            return
        self._bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False, dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")

    def phase(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)
        elif self._lines:
            print(f"[blockhess] {text}", file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def note(self, text: str) -> None:
        """A message after the run (a file written): shown on a terminal only."""
        if self.enabled:
            print(f"[blockhess] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __bool__(self) -> bool:
        return self.enabled


# ---------------------------------------------------------------------------------------------
# The check


def run_check(cfg: Config, progress: _Progress | None = None) -> tuple[Report, dict[str, Any]]:
    """Compute, verify and summarise; returns the report and the arrays (for plotting)."""
    bar = progress if progress is not None else _Progress(False)
    reference = _resolve_reference(cfg.reference)
    X, target, weights, head = make_problem(cfg)
    Xd, *wd = _to_device([X, *weights], cfg.device)
    target_d = _to_device([target], cfg.device)[0]  # class indices too: no host/device mixing
    params = _params(wd, cfg)
    P = params.size
    slices = params.slices()
    pairs = [(a, b) for i, a in enumerate(params.names) for b in params.names[i:]]
    closed_form = f"closed form, P = {P} ({cfg.device}, {cfg.dtype})"
    bar.start(7 + (2 if reference == "torch" else P) + len(pairs), closed_form)
    bar.phase(closed_form)
    kwargs = dict(loss=cfg.loss, eps=cfg.eps, head=head)
    loss_hessian(Xd, target_d, params, **kwargs)  # warm-up
    bar.advance()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        full = loss_hessian(Xd, target_d, params, **kwargs)
        if cfg.device == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - t0)
        bar.advance()
    outer = _to_host(loss_hessian(Xd, target_d, params, part="outer", **kwargs))
    bar.advance()
    functional = _to_host(loss_hessian(Xd, target_d, params, part="functional", **kwargs))
    bar.advance()
    full = _to_host(full)
    value = float(loss_value(Xd, target_d, params, **kwargs))
    bar.phase("matrix-free H v")
    hvp = _check_hvp(X, target, weights, full, cfg, head) if cfg.device == "cpu" else None
    bar.advance()

    if reference == "torch":
        bar.phase("reference: torch.func.hessian")
        H_ref, t_ref = _torch_reference(X, target, weights, cfg, bar, head)
    else:
        bar.phase("reference: finite differences")
        H_ref, t_ref = _finite_difference_reference(X, target, _params(weights, cfg), cfg, bar, head)

    # Tolerances with an absolute floor (see NOISE_MULTIPLE): error <= tol * max(||ref||, floor).
    tolerance = TOLERANCE[(reference, cfg.dtype)]
    sigma_min = _smallest_layernorm_sigma(X, weights, cfg)
    noise = NOISE_MULTIPLE * _rounding_noise(P, value, sigma_min, cfg.dtype, reference)  # = tolerance * floor
    floor = noise / tolerance
    ref_norm = _fro(H_ref)

    bar.phase("per-block norms and errors")
    blocks = []
    for a, b in pairs:
        sa, sb = slices[a], slices[b]
        blk = full[sa, sb]
        ref_blk = H_ref[sa, sb]
        denominator = max(_fro(ref_blk), 1e-4 * ref_norm)  # blocks that vanish: measured against the whole
        abs_err = _fro_of_difference(blk, ref_blk)
        blocks.append(BlockReport(
            block=f"{a}-{b}", shape=tuple(blk.shape),
            spectral_norm=_spectral_norm(blk),
            outer_fro=_fro(outer[sa, sb]),
            functional_fro=_fro(functional[sa, sb]),
            rel_error=abs_err / denominator if denominator > noise else None,
            abs_error=abs_err,
            ok=abs_err <= tolerance * max(denominator, floor),
        ))
        bar.advance()
    abs_error = _fro_of_difference(full, H_ref)
    full_norm = _fro(full)
    split_residual = _fro_of_split_residual(outer, functional, full)
    split_tol = SPLIT_TOLERANCE[cfg.dtype]
    split_noise = NOISE_MULTIPLE * _rounding_noise(P, value, sigma_min, cfg.dtype, "torch")
    best = min(times)
    # perf_counter cannot return 0 for a real call, but a coarse clock could: never divide by 0.
    resolution = time.get_clock_info("perf_counter").resolution
    report = Report(
        config=cfg, P=P, reference=reference, tolerance=tolerance, loss_value=value,
        rel_error=abs_error / ref_norm if ref_norm > noise else None,
        max_asymmetry=_max_asymmetry(full),
        split_error=split_residual / full_norm if full_norm > split_noise else None,
        time_closed_form_s=best, time_reference_s=t_ref,
        speedup=t_ref / max(best, resolution, 1e-12), blocks=blocks,
        abs_error=abs_error, reference_norm=ref_norm, error_floor=floor,
    )
    if hvp is not None:
        hv_error, hv_scale, report.time_hvp_s = hvp
        report.hvp_rel_error = hv_error / hv_scale if hv_scale > noise else None
        report.hvp_ok = hv_error <= HVP_TOLERANCE[cfg.dtype] * max(hv_scale, floor)
    report.ok = bool(
        report.hvp_ok
        and abs_error <= tolerance * max(ref_norm, floor)
        and all(blk.ok for blk in blocks)
        and report.max_asymmetry == 0.0
        and split_residual <= split_tol * max(full_norm, split_noise / split_tol)
    )
    return report, {"full": full, "slices": slices}


def _check_hvp(X, target, weights, full: np.ndarray, cfg: Config, head=None) -> tuple[float, float, float]:
    """(||H V - full V||_F, ||full V||_F, seconds per product) for the matrix-free operator on
    HVP_VECTORS random unit vectors."""
    op = hessian_operator(X, target, _params(weights, cfg), loss=cfg.loss, eps=cfg.eps, head=head)
    V = np.random.default_rng(cfg.seed + 1).standard_normal((op.shape[0], HVP_VECTORS)).astype(full.dtype)
    V /= np.linalg.norm(V, axis=0)
    op.matvec(V[:, 0])  # warm-up
    t0 = time.perf_counter()
    HV = np.stack([op.matvec(V[:, j]) for j in range(HVP_VECTORS)], axis=1)
    seconds = (time.perf_counter() - t0) / HVP_VECTORS
    dense = full @ V
    return _fro(HV - dense), _fro(dense), seconds


def format_report(r: Report) -> str:
    c = r.config
    lines = [
        f"blockhess check: {c.describe()}, L={c.L} d={c.d} d_k={c.d_k}{'' if c.attention_only else f' d_ff={c.d_ff}'} "
        f"batch={c.batch} loss={c.loss}{f' classes={c.classes}' if c.pooled else ''} eps={c.eps} {c.dtype} "
        f"on {c.device}, seed {c.seed}",
        f"P = {r.P} parameters ({', '.join(name for name, _ in c.parameters())}), loss = {r.loss_value:.6g}",
        "",
        f"{'block':<10} {'shape':>12} {'||H||_2':>11} {'||outer||_F':>12} {'||funct.||_F':>12} {'rel. error':>11}",
    ]
    for b in r.blocks:
        shape = f"{b.shape[0]}x{b.shape[1]}"
        flag = "" if b.ok else "  <-- above tolerance"
        err = "n/a" if b.rel_error is None else f"{b.rel_error:.2e}"
        lines.append(f"{b.block:<10} {shape:>12} {b.spectral_norm:11.4e} {b.outer_fro:12.4e} "
                     f"{b.functional_fro:12.4e} {err:>11}{flag}")
    if r.rel_error is None:
        zero = "0" if r.reference_norm == 0 else f"{r.reference_norm:.1e}, rounding noise"
        error = f"relative error n/a (zero reference: ||H_ref||_F = {zero}; ||H - H_ref||_F = {r.abs_error:.2e})"
    else:
        error = f"relative error {r.rel_error:.2e}"
    tolerance = f"tolerance {r.tolerance:g}"
    if r.reference_norm < r.error_floor:  # the absolute floor is what the error was held to
        tolerance += f"; absolute {r.tolerance * r.error_floor:.1e}, this problem's rounding-noise floor"
    split = "n/a (zero |full|)" if r.split_error is None else f"{r.split_error:.1e}"
    lines += [
        "",
        f"whole Hessian: {error} against {r.reference} ({tolerance}); "
        f"symmetric: max |H - H^T| = {r.max_asymmetry:g}; |outer + functional - full| / |full| = {split}",
        f"time: closed form {1e3 * r.time_closed_form_s:.1f} ms, {r.reference} {1e3 * r.time_reference_s:.1f} ms "
        f"-> speed-up {r.speedup:.1f}x",
        _format_hvp(r),
        "OK" if r.ok else "FAILED: an error exceeds its tolerance",
    ]
    return "\n".join(lines)


def _format_hvp(r: Report) -> str:
    if r.time_hvp_s is None:
        return "matrix-free H v: not checked (hessian_operator runs on the CPU only)"
    error = "n/a (zero H)" if r.hvp_rel_error is None else f"{r.hvp_rel_error:.1e}"
    flag = "" if r.hvp_ok else "  <-- above tolerance"
    return (f"matrix-free H v (hessian_operator, {HVP_VECTORS} vectors): relative error {error} against the dense H, "
            f"{1e3 * r.time_hvp_s:.2f} ms per product{flag}")


def plot_heatmap(full: np.ndarray, slices: dict[str, slice], path: str, title: str) -> None:
    """log10 |H| with block boundaries and labels (the paper's Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mag = np.log10(np.abs(full.astype(np.float64)) + 1e-300)
    finite = mag[np.abs(full) > 0]
    vmin = np.percentile(finite, 1) if finite.size else -16
    vmax = max(float(mag.max()), vmin + 1)  # an all-zero Hessian (d=1) still gets a colour scale
    fig, ax = plt.subplots(figsize=(7.5, 6.5), dpi=130)
    im = ax.imshow(mag, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
    fig.colorbar(im, ax=ax, label=r"$\log_{10}|H_{ij}|$")
    ticks = []
    for name, s in slices.items():
        for edge in (s.start, s.stop):
            ax.axhline(edge - 0.5, color="white", lw=0.6)
            ax.axvline(edge - 0.5, color="white", lw=0.6)
        ticks.append(((s.start + s.stop) / 2, name))
    ax.set_xticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Validation: everything that can be known before the computation


def _available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _device_free_memory() -> int | None:
    """Free bytes on the current GPU, or None when CuPy cannot say."""
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # noqa: BLE001 - any failure only means "unknown"
        return None


def _closed_form_working(cfg: Config, itemsize: int) -> int:
    """Bytes that one loss_hessian call allocates besides its result."""
    from . import _working_memory

    return _working_memory.block(cfg.batch, cfg.L, cfg.d, cfg.d_k, cfg.d_ff, itemsize, hessian=True,
                                 heads=cfg.heads, P=_parameter_count(cfg), pooled=cfg.pooled)


def _memory_needs(cfg: Config, P: int, reference: str) -> dict[str, int]:
    """Estimated bytes of the check's large arrays (over-counted on purpose)."""
    itemsize = np.dtype(cfg.dtype).itemsize
    B, L = cfg.batch, cfg.L
    hessian = P * P * itemsize + _closed_form_working(cfg, itemsize)  # what loss_hessian asks the budget for
    kept = 3 * P * P * itemsize  # full, outer and functional, kept for the report
    if reference == "torch":
        # torch.func.hessian runs the block's reverse pass vmapped over all P tangent directions at
        # once: every intermediate (about L*(L + d + d_k + d_ff) entries per sample) is materialised
        # P times, with a few (P, P) arrays. Measured peaks (L 20..100, batch 1..8, d_ff 64..256)
        # were 0.5-0.9 of this estimate (torch's own runtime not counted: _TORCH_OVERHEAD).
        per_direction = L * (L + cfg.d + cfg.d_k + cfg.d_ff)
        ref = 8 * (8 * P * P + 4 * (B + 1) * P * per_direction)
    else:
        ref = 8 * P * P + 2 * _closed_form_working(cfg, itemsize)
    widest = max(cfg.d * cfg.d_k, cfg.d * cfg.d, cfg.d * cfg.d_ff)
    extra = 4 * 8 * widest * widest + 4 * 8 * B * L * (L + cfg.d + cfg.d_ff)  # block SVDs, the problem
    total = kept + _closed_form_working(cfg, itemsize) + ref + extra
    if reference == "torch":
        total += _TORCH_OVERHEAD
    return {"hessian": hessian, "reference": ref, "total": total, "device": 2 * P * P * itemsize}


def _parameter_count(cfg: Config) -> int:
    return sum(math.prod(shape) for _, shape in cfg.parameters())


def _largest_fitting_P(cfg: Config, reference: str, key: str, limit: int) -> int:
    """About the largest P (other sizes kept) whose need ``key`` fits ``limit``; 0 if none."""
    def fits(P: int) -> bool:
        return _memory_needs(cfg, P, reference)[key] <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def memory_budget() -> int:
    """The memory budget; UsageError for a bad BLOCKHESS_MEMORY_BUDGET."""
    from ._config import get_memory_budget

    try:
        return get_memory_budget()
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


def _check_memory(cfg: Config, reference: str) -> None:
    budget = memory_budget()
    available = _available_memory()
    P = _parameter_count(cfg)
    need = _memory_needs(cfg, P, reference)
    sizes = (f"--L {cfg.L} --d {cfg.d} --d-k {cfg.d_k} --d-ff {cfg.d_ff}"
             + (f" --batch {cfg.batch}" if cfg.batch > 1 else ""))
    asked = f"{sizes} gives P = {P} parameters"
    fd = "finite-differences"
    fd_need = _memory_needs(cfg, P, fd)
    fd_fits = available is None or fd_need["total"] <= available

    def smaller(key: str, limit: int) -> str:
        fit = _largest_fitting_P(cfg, reference, key, limit)
        if fit == 0:
            return "use smaller sizes (fewer tokens or samples)"
        at = f"--L {cfg.L}" + (f" --batch {cfg.batch}" if cfg.batch > 1 else "")
        return f"use smaller sizes (at {at}, about P = {fit} fits; P = 2*d*d_k + d^2 + 2*d*d_ff)"

    def raise_budget(amount: int) -> str:
        if available is not None and need["total"] > available:
            return ""
        return f", or raise BLOCKHESS_MEMORY_BUDGET (e.g. BLOCKHESS_MEMORY_BUDGET={math.ceil(amount / 2**30)}GiB)"

    if need["hessian"] > budget:
        raise UsageError(
            f"{asked}: the closed-form Hessian ({P}x{P} {cfg.dtype} and working memory) needs "
            f"{format_bytes(need['hessian'])}, more than the memory budget of {format_bytes(budget)}; "
            f"{smaller('hessian', budget)}{raise_budget(need['hessian'])}")
    # The reference's own memory (torch's, or the finite differences') is not blockhess's to budget:
    # it is checked against what the machine has, below.
    if available is not None and need["total"] > available:
        alternatives = smaller("total", available)
        if reference == "torch" and fd_fits:
            alternatives = (f"use --reference finite-differences (about {format_bytes(fd_need['total'])} in all, "
                            f"but 2P gradients: slower), or {alternatives}")
        raise UsageError(
            f"{asked}: the check needs about {format_bytes(need['total'])} of memory, but only "
            f"{format_bytes(available)} is available on this machine; {alternatives}")
    if cfg.device == "cuda":
        free = _device_free_memory()
        if free is not None and need["device"] > free:
            raise UsageError(
                f"{asked}: the closed form needs about {format_bytes(need['device'])} on the GPU, but only "
                f"{format_bytes(free)} is free there; {smaller('device', free)}, or use --device cpu")


def check_outputs(outputs: dict[str, str | None]) -> None:
    """The output files asked for (option -> path, None where not asked for) can be written, each to a
    path of its own (blockhess._command_files); UsageError otherwise. Nothing is created."""
    asked = {option: path for option, path in outputs.items() if path is not None}
    try:
        for option, path in asked.items():
            _command_files.check_output_file(path, option)
        _command_files.check_distinct(asked)
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_plot_format(path: str, option: str) -> None:
    """matplotlib is installed and writes the format of ``path``'s extension."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError(f"{option} needs matplotlib: pip install 'blockhess[plot]'") from None
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise UsageError(f"{option} {path}: matplotlib cannot write .{extension} files "
                         f"(it writes {', '.join('.' + f for f in sorted(formats))})")


def check_seed(seed: int) -> None:
    """--seed within 0 .. MAX_SEED: UsageError."""
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be >= 0 and <= {MAX_SEED} (2**32 - 1), got {seed}")


def validate_block(cfg: Config) -> None:
    """The sizes, seed, eps and block options (shared with ``blockhess spectrum``): UsageError."""
    for name in ("L", "d", "d_k", "d_ff", "batch", "heads", "classes"):
        value = getattr(cfg, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_seed(cfg.seed)
    if not math.isfinite(cfg.eps) or cfg.eps < 0:
        raise UsageError(f"--eps must be a finite number >= 0, got {cfg.eps}")
    if cfg.d == 1 and cfg.eps == 0 and not cfg.attention_only:
        raise UsageError("--d 1 with --eps 0: LayerNorm of a single feature has zero variance (0/0); "
                         "pass --eps > 0, e.g. --eps 1e-5")
    try:
        cfg.spec  # options that mean nothing together (e.g. --attention-only with --norm rmsnorm)
    except ValueError as err:
        raise UsageError(f"the block options do not go together: {err}") from None
    try:
        cfg.parameters()  # the spec's own constraints (e.g. heads * d_v == d without --out-proj)
    except ValueError as err:
        raise UsageError(f"the block options do not fit the sizes: {err}") from None


def validate(cfg: Config, args: Any) -> None:
    """Refuse every bad option or combination before any computation: raises UsageError with a
    one-line message (main() prints it as ``blockhess check: error: ...``, exit status 2)."""
    validate_block(cfg)
    if cfg.device == "cuda" and (not cfg.spec.is_paper_block or cfg.pooled):
        raise UsageError("--device cuda runs the paper's block with --loss mse or cross_entropy only so far; "
                         "drop the block options and the pooled loss, or use --device cpu")
    if cfg.device == "cuda":
        from ._backend import cuda_available

        try:
            import cupy  # noqa: F401
        except ImportError:
            raise UsageError("--device cuda needs CuPy: pip install 'blockhess[cuda]'") from None
        if not cuda_available():
            raise UsageError("--device cuda needs a CUDA build of blockhess and a visible GPU "
                             "(blockhess.cuda_available() is False)")
    reference = _resolve_reference(cfg.reference)
    if reference == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise UsageError("--reference torch needs PyTorch (pip install 'torch==2.13.0'); "
                             "or use --reference finite-differences") from None
    _check_memory(cfg, reference)
    json_path, plot_path = getattr(args, "json", None), getattr(args, "plot", None)
    check_outputs({"--json": json_path, "--plot": plot_path})
    if plot_path is not None:
        check_plot_format(plot_path, "--plot")


# The command lines: an error raised in them is a bug of theirs, not one about the data.
_COMMANDS = ("blockhess.__main__", "blockhess.check", "blockhess.spectrum_cli", "blockhess.report")


def _raised_by_blockhess(err: BaseException) -> bool:
    """True when the innermost frame of ``err`` is blockhess's own code outside the command lines (its
    input validation, or the C++ core called from it): an error about the data, not a bug there."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module.startswith("blockhess.") and module not in _COMMANDS


# ---------------------------------------------------------------------------------------------
# The command


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``blockhess check: error: ...`` (no usage block), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


_NUMERIC_OPTIONS = ("--L", "--d", "--d-k", "--d-ff", "--batch", "--seed", "--eps", "--heads", "--classes")


def _attach_negative_numbers(argv: list[str]) -> list[str]:
    """``--eps -1e-3`` -> ``--eps=-1e-3``: argparse takes only plain negative numbers such as -1 for
    values, so a negative value in another form would get a puzzling "expected one argument"."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            out += argv[i:]
            break
        if word in _NUMERIC_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{word}={argv[i + 1]}")
                i += 2
                continue
        out.append(word)
        i += 1
    return out


def run_command(prog: str, command: Callable[[list[str]], int], argv: list[str]) -> int:
    """``command(argv)`` with Ctrl-C (SystemExit(130), one line) and a reader that goes away
    (SystemExit(141)) ended without a traceback."""
    try:
        return command(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except BrokenPipeError:  # e.g. blockhess check | head: nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise SystemExit(141) from None


@contextlib.contextmanager
def errors_in_the_data(parser: argparse.ArgumentParser, out_of_memory_hint: str = "") -> Iterator[None]:
    """An error that blockhess raises about the data during a run (ValueError, TypeError, and their
    subclasses OutputTooLargeError and NonFiniteError) as one line, parser.error (exit status 2); a bug
    keeps its traceback. Running out of memory (the estimates are generous, but machines are shared)
    is one line too."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if not _raised_by_blockhess(err):
            raise
        parser.error(str(err))
    except MemoryError as err:
        parser.error(f"out of memory ({err or 'an allocation failed'}); use smaller sizes{out_of_memory_hint}")


@contextlib.contextmanager
def writing_outputs(parser: argparse.ArgumentParser) -> Iterator[None]:
    """A write that fails although its path was checked (a full disk, a file system that lies about
    permissions) as one line, parser.error (exit status 2)."""
    try:
        yield
    except OSError as err:
        parser.error(f"cannot write {err.filename or 'the output'}: {err.strerror or err}")


def main(argv: list[str]) -> int:
    """``blockhess check [options]``: 0 verified, 1 an error above its tolerance; SystemExit(2) for a
    bad option or an error in the data (one line on stderr), SystemExit(130) when interrupted."""
    return run_command("blockhess check", _main, argv)


def add_block_options(parser: argparse.ArgumentParser) -> None:
    """The sizes, the loss and the block's spec options (shared by ``blockhess spectrum``)."""
    defaults = Config()
    parser.add_argument("--L", type=int, default=defaults.L, help="tokens per sample (default 49, the paper's MNIST block)")
    parser.add_argument("--d", type=int, default=defaults.d, help="model width (default 16)")
    parser.add_argument("--d-k", dest="d_k", type=int, default=defaults.d_k, help="query/key width per head (default 16)")
    parser.add_argument("--d-ff", dest="d_ff", type=int, default=defaults.d_ff, help="FFN width (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="samples; > 1 gives the batch-mean Hessian")
    parser.add_argument("--loss", choices=("mse", "cross_entropy", "pooled_cross_entropy"), default="mse",
                        help="pooled_cross_entropy: the paper's ViT classifier (mean over tokens, a fixed "
                        "random linear head of --classes outputs, one class per sample)")
    parser.add_argument("--classes", type=int, default=defaults.classes,
                        help="classes of the pooled head (default 10)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=0.0,
                        help="LayerNorm epsilon (default 0, as in the paper; --d 1 needs eps > 0)")
    block = parser.add_argument_group("the block (defaults: the paper's post-LN block)")
    block.add_argument("--norm-position", dest="norm_position", choices=("post", "pre"), default="post")
    block.add_argument("--norm", choices=("layernorm", "rmsnorm"), default="layernorm")
    block.add_argument("--affine", action="store_true", help="trainable gamma (and beta) in both norms")
    block.add_argument("--bias", action="store_true", help="a bias on every linear map")
    block.add_argument("--heads", type=int, default=1, help="attention heads (d_k per head; d_v = d / heads)")
    block.add_argument("--out-proj", dest="out_proj", action="store_true", help="W_O after the heads")
    block.add_argument("--activation", choices=ACTIVATIONS, default="relu")
    block.add_argument("--causal", action="store_true", help="mask keys after the query")
    block.add_argument("--attention-only", dest="attention_only", action="store_true",
                       help="the self-attention sublayer alone, Z = attn(X) (the paper's Thm 1; no norms, no FFN, "
                            "--d-ff ignored)")


def config_from_args(args: Any, **extra: Any) -> Config:
    return Config(L=args.L, d=args.d, d_k=args.d_k, d_ff=args.d_ff, batch=args.batch, loss=args.loss,
                  dtype=args.dtype, seed=args.seed, eps=args.eps, norm_position=args.norm_position, norm=args.norm,
                  affine=args.affine, bias=args.bias, heads=args.heads, out_proj=args.out_proj,
                  activation=args.activation, causal=args.causal, attention_only=args.attention_only,
                  classes=args.classes, **extra)


def _main(argv: list[str]) -> int:
    parser = _ArgumentParser(
        prog="blockhess check",
        description="Compute a Transformer block's loss Hessian in closed form, verify it against "
        "autograd (or finite differences), and report per-block norms, errors and timings. "
        "Exit status: 0 verified, 1 an error exceeds its tolerance, 2 a bad option (nothing computed) "
        "or an error in the data, 130 interrupted.",
    )
    add_block_options(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reference", choices=("auto", "torch", "finite-differences"), default="auto",
                        help="auto: torch.func.hessian if torch is installed, else finite differences "
                        "(which needs less memory)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the log|H| heat map (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (it is shown only when stderr is a terminal)")
    args = parser.parse_args(_attach_negative_numbers(list(argv)))
    cfg = config_from_args(args, device=args.device, reference=args.reference)
    try:
        validate(cfg, args)
    except UsageError as err:
        parser.error(str(err))

    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    torch_hint = " or --reference finite-differences" if _resolve_reference(cfg.reference) == "torch" else ""
    with errors_in_the_data(parser, torch_hint):
        try:
            report, arrays = run_check(cfg, progress)
        finally:
            progress.close()

    print(format_report(report), flush=True)
    with writing_outputs(parser):
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(asdict(report), fh, indent=2)
        if args.plot:
            c = cfg
            plot_heatmap(arrays["full"], arrays["slices"], args.plot,
                         f"log|H| of the block loss Hessian ({c.describe()}, L={c.L}, d={c.d}, d_k={c.d_k}, "
                         f"d_ff={c.d_ff}, {c.loss})")
            progress.note(f"heat map written to {args.plot}")
    return 0 if report.ok else 1
