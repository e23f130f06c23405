"""What ``blockhess check`` found: the report (per block and for the whole Hessian), as text, and
the heat map of log |H|."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._check_comparison import HVP_VECTORS
from ._check_config import Config


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
        return "matrix-free H v: not checked"
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
