"""``blockhess check``: compute a block's loss Hessian in closed form, verify it, show what it found.

The verification is independent of blockhess's formulas: ``torch.func.hessian`` of the same block
written in PyTorch (float64) when torch is installed, else central finite differences of the exact
closed-form gradient.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .block import PARAM_NAMES, BlockParams, loss_gradient, loss_hessian, loss_value

# Relative Frobenius error allowed against each reference, by dtype.
TOLERANCE = {
    ("torch", "float64"): 1e-10,
    ("torch", "float32"): 1e-4,
    ("finite-differences", "float64"): 1e-5,
    ("finite-differences", "float32"): 1e-2,
}


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


@dataclass
class BlockReport:
    block: str
    shape: tuple[int, int]
    spectral_norm: float
    outer_fro: float
    functional_fro: float
    rel_error: float


@dataclass
class Report:
    config: Config
    P: int
    reference: str
    tolerance: float
    loss_value: float
    rel_error: float
    max_asymmetry: float
    split_error: float
    time_closed_form_s: float
    time_reference_s: float
    speedup: float
    blocks: list[BlockReport] = field(default_factory=list)
    ok: bool = False


def make_problem(cfg: Config):
    """Seeded input, target and weights (weights scaled by 1/sqrt(fan-in), as at initialisation)."""
    rng = np.random.default_rng(cfg.seed)
    lead = (cfg.L,) if cfg.batch == 1 else (cfg.batch, cfg.L)
    X = rng.standard_normal((*lead, cfg.d))
    shapes = [(cfg.d, cfg.d_k), (cfg.d, cfg.d_k), (cfg.d, cfg.d), (cfg.d, cfg.d_ff), (cfg.d_ff, cfg.d)]
    weights = [rng.standard_normal(s) / math.sqrt(s[0]) for s in shapes]
    if cfg.loss == "mse":
        target = rng.standard_normal((*lead, cfg.d))
    else:
        target = rng.integers(0, cfg.d, size=lead)
    dtype = np.dtype(cfg.dtype)
    X = X.astype(dtype)
    weights = [w.astype(dtype) for w in weights]
    if cfg.loss == "mse":
        target = target.astype(dtype)
    return X, target, weights


def _torch_reference(X, target, weights, cfg: Config):
    """torch.func.hessian of the loss of the block written directly in PyTorch, float64."""
    import torch

    shapes = [w.shape for w in weights]
    Xt = torch.as_tensor(np.asarray(X, dtype=np.float64))
    if cfg.loss == "mse":
        tgt = torch.as_tensor(np.asarray(target, dtype=np.float64))
    else:
        tgt = torch.as_tensor(np.asarray(target, dtype=np.int64))

    def layernorm(S):
        centred = S - S.mean(-1, keepdim=True)
        return centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + cfg.eps)

    def loss_of(v):
        ws, o = [], 0
        for r, c in shapes:
            ws.append(v[o:o + r * c].reshape(r, c))
            o += r * c
        WQ, WK, WV, W1, W2 = ws
        T = Xt @ WQ @ WK.T @ Xt.transpose(-1, -2) / math.sqrt(cfg.d_k)
        Y = layernorm(Xt + torch.softmax(T, dim=-1) @ Xt @ WV)
        Z = layernorm(torch.relu(Y @ W1) @ W2 + Y)
        if cfg.loss == "mse":
            return ((Z - tgt) ** 2).mean()
        return torch.nn.functional.cross_entropy(Z.reshape(-1, cfg.d), tgt.reshape(-1))

    v0 = torch.cat([torch.as_tensor(np.asarray(w, dtype=np.float64)).reshape(-1) for w in weights])
    hess = torch.func.hessian(loss_of)
    hess(v0)  # warm-up
    t0 = time.perf_counter()
    H = hess(v0)
    return H.numpy(), time.perf_counter() - t0


def _finite_difference_reference(X, target, params: BlockParams, cfg: Config, progress):
    """Central differences of the exact gradient, one parameter at a time."""
    v0 = np.asarray(params.flatten(), dtype=np.float64)
    P = v0.size
    h = 1e-5 if cfg.dtype == "float64" else 1e-2
    cols = np.empty((P, P))
    t0 = time.perf_counter()
    for k in range(P):
        e = np.zeros(P)
        e[k] = h
        plus = BlockParams.unflatten((v0 + e).astype(cfg.dtype), params)
        minus = BlockParams.unflatten((v0 - e).astype(cfg.dtype), params)
        g_plus = loss_gradient(X, target, plus, loss=cfg.loss, eps=cfg.eps)
        g_minus = loss_gradient(X, target, minus, loss=cfg.loss, eps=cfg.eps)
        cols[:, k] = (g_plus - g_minus) / (2 * h)
        if progress and (k % max(1, P // 20) == 0 or k == P - 1):
            progress(f"finite differences: {k + 1}/{P} columns")
    return 0.5 * (cols + cols.T), time.perf_counter() - t0


def _rel(a, b) -> float:
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / nb if nb > 0 else float(np.linalg.norm(a - b))


def _to_device(arrays, device):
    if device == "cpu":
        return arrays
    import cupy

    return [cupy.asarray(a) for a in arrays]


def _to_host(a):
    return a.get() if hasattr(a, "__cuda_array_interface__") else np.asarray(a)


def run_check(cfg: Config, progress=None) -> tuple[Report, dict[str, Any]]:
    """Compute, verify and summarise; returns the report and the arrays (for plotting)."""
    say = progress or (lambda msg: None)
    X, target, weights = make_problem(cfg)
    Xd, *wd = _to_device([X, *weights], cfg.device)
    target_d = _to_device([target], cfg.device)[0]  # class indices too: no host/device mixing
    params = BlockParams(*wd)
    P = params.size

    say(f"closed form: loss Hessian over {P} parameters ({cfg.device}, {cfg.dtype})")
    kwargs = dict(loss=cfg.loss, eps=cfg.eps)
    loss_hessian(Xd, target_d, params, **kwargs)  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        full = loss_hessian(Xd, target_d, params, **kwargs)
        if cfg.device == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - t0)
    outer = _to_host(loss_hessian(Xd, target_d, params, part="outer", **kwargs))
    functional = _to_host(loss_hessian(Xd, target_d, params, part="functional", **kwargs))
    full = _to_host(full)
    value = loss_value(Xd, target_d, params, **kwargs)

    reference = cfg.reference
    if reference == "auto":
        try:
            import torch  # noqa: F401

            reference = "torch"
        except ImportError:
            reference = "finite-differences"
    say(f"reference: {reference}")
    if reference == "torch":
        H_ref, t_ref = _torch_reference(X, target, weights, cfg)
    else:
        host_params = BlockParams(*weights)
        H_ref, t_ref = _finite_difference_reference(X, target, host_params, cfg, say)

    tolerance = TOLERANCE[(reference, cfg.dtype)]
    slices = params.slices()
    blocks = []
    for i, a in enumerate(PARAM_NAMES):
        for b in PARAM_NAMES[i:]:
            sa, sb = slices[a], slices[b]
            blk = full[sa, sb]
            ref_blk = H_ref[sa, sb]
            floor = 1e-4 * np.linalg.norm(H_ref)  # blocks that vanish are measured against the whole
            err = float(np.linalg.norm(blk - ref_blk)) / max(float(np.linalg.norm(ref_blk)), floor)
            blocks.append(BlockReport(
                block=f"{a}-{b}", shape=tuple(blk.shape),
                spectral_norm=float(np.linalg.svd(blk.astype(np.float64), compute_uv=False)[0]),
                outer_fro=float(np.linalg.norm(outer[sa, sb])),
                functional_fro=float(np.linalg.norm(functional[sa, sb])),
                rel_error=err,
            ))
    rel_error = _rel(full, H_ref)
    report = Report(
        config=cfg, P=P, reference=reference, tolerance=tolerance, loss_value=float(value),
        rel_error=rel_error,
        max_asymmetry=float(np.abs(full - full.T).max()),
        split_error=_rel(outer + functional, full),
        time_closed_form_s=min(times), time_reference_s=t_ref,
        speedup=t_ref / min(times), blocks=blocks,
    )
    report.ok = (rel_error <= tolerance and all(b.rel_error <= tolerance for b in blocks)
                 and report.max_asymmetry == 0.0 and report.split_error <= 1e-12 * (1e8 if cfg.dtype == "float32" else 1))
    return report, {"full": full, "slices": slices}


def format_report(r: Report) -> str:
    c = r.config
    lines = [
        f"blockhess check: post-LN Transformer block, L={c.L} d={c.d} d_k={c.d_k} d_ff={c.d_ff} "
        f"batch={c.batch} loss={c.loss} eps={c.eps} {c.dtype} on {c.device}, seed {c.seed}",
        f"P = {r.P} parameters (W_Q, W_K, W_V, W_1, W_2), loss = {r.loss_value:.6g}",
        "",
        f"{'block':<10} {'shape':>12} {'||H||_2':>11} {'||outer||_F':>12} {'||funct.||_F':>12} {'rel. error':>11}",
    ]
    for b in r.blocks:
        shape = f"{b.shape[0]}x{b.shape[1]}"
        flag = "" if b.rel_error <= r.tolerance else "  <-- above tolerance"
        lines.append(f"{b.block:<10} {shape:>12} {b.spectral_norm:11.4e} {b.outer_fro:12.4e} "
                     f"{b.functional_fro:12.4e} {b.rel_error:11.2e}{flag}")
    lines += [
        "",
        f"whole Hessian: relative error {r.rel_error:.2e} against {r.reference} (tolerance {r.tolerance:g}); "
        f"symmetric: max |H - H^T| = {r.max_asymmetry:g}; |outer + functional - full| / |full| = {r.split_error:.1e}",
        f"time: closed form {1e3 * r.time_closed_form_s:.1f} ms, {r.reference} {1e3 * r.time_reference_s:.1f} ms "
        f"-> speed-up {r.speedup:.1f}x",
        "OK" if r.ok else "FAILED: an error exceeds its tolerance",
    ]
    return "\n".join(lines)


def plot_heatmap(full: np.ndarray, slices: dict[str, slice], path: str, title: str) -> None:
    """log10 |H| with block boundaries and labels (the paper's Figure 3)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'blockhess[plot]'") from None
    mag = np.log10(np.abs(full.astype(np.float64)) + 1e-300)
    finite = mag[np.abs(full) > 0]
    vmin = np.percentile(finite, 1) if finite.size else -16
    fig, ax = plt.subplots(figsize=(7.5, 6.5), dpi=130)
    im = ax.imshow(mag, cmap="viridis", vmin=vmin, vmax=mag.max(), interpolation="nearest")
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


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="blockhess check",
        description="Compute a Transformer block's loss Hessian in closed form, verify it against "
        "autograd (or finite differences), and report per-block norms, errors and timings.",
    )
    defaults = Config()
    parser.add_argument("--L", type=int, default=defaults.L, help="tokens per sample (default 49, the paper's MNIST block)")
    parser.add_argument("--d", type=int, default=defaults.d, help="model width (default 16)")
    parser.add_argument("--d-k", dest="d_k", type=int, default=defaults.d_k, help="query/key width (default 16)")
    parser.add_argument("--d-ff", dest="d_ff", type=int, default=defaults.d_ff, help="FFN width (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="samples; > 1 gives the batch-mean Hessian")
    parser.add_argument("--loss", choices=("mse", "cross_entropy"), default="mse")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps", type=float, default=0.0, help="LayerNorm epsilon (default 0, as in the paper)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reference", choices=("auto", "torch", "finite-differences"), default="auto",
                        help="auto: torch.func.hessian if torch is installed, else finite differences")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the log|H| heat map (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")
    args = parser.parse_args(argv)
    for name in ("L", "d", "d_k", "d_ff", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.device == "cuda":
        from ._backend import cuda_available

        try:
            import cupy  # noqa: F401
        except ImportError:
            parser.error("--device cuda needs CuPy: pip install 'blockhess[cuda]'")
        if not cuda_available():
            parser.error("--device cuda needs a CUDA build of blockhess and a visible GPU "
                         "(blockhess.cuda_available() is False)")
    cfg = Config(L=args.L, d=args.d, d_k=args.d_k, d_ff=args.d_ff, batch=args.batch, loss=args.loss,
                 dtype=args.dtype, seed=args.seed, eps=args.eps, device=args.device, reference=args.reference)
    progress = None if args.quiet else (lambda msg: print(f"[blockhess] {msg}", file=sys.stderr, flush=True))
    report, arrays = run_check(cfg, progress)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(report), fh, indent=2)
    if args.plot:
        c = cfg
        plot_heatmap(arrays["full"], arrays["slices"], args.plot,
                     f"log|H| of the block loss Hessian (L={c.L}, d={c.d}, d_k={c.d_k}, d_ff={c.d_ff}, {c.loss})")
        if progress:
            progress(f"heat map written to {args.plot}")
    return 0 if report.ok else 1
