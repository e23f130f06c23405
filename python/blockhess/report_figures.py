"""The figures of ``blockhess report`` that are not the experiments' (those are in
blockhess.experiments): the bounds' tightness and the scaling sweeps. matplotlib, Agg backend."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def require_matplotlib() -> None:
    """ImportError, saying what to install, unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError('the report draws its figures with matplotlib: pip install "blockhess[paper]"') from err


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tightness(summary: list[dict], path: str) -> str:
    """exact / corrected and exact / stated over the random configurations, per quantity."""
    plt = _pyplot()
    names = [row["quantity"] for row in summary]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(names) + 1.5))
    y = np.arange(len(names))
    lo = [row["tightness_min"] for row in summary]
    hi = [row["tightness_max"] for row in summary]
    ax.hlines(y, lo, hi, color="tab:blue", lw=4, label="exact / corrected (min to max)")
    stated = [row["stated_ratio_max"] for row in summary]
    ax.scatter([s if s is not None else np.nan for s in stated], y, color="tab:red", marker="x", zorder=3,
               label="largest exact / stated")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (right of 1: the bound fails)")
    ax.set_title("How tight the bounds are over the random configurations")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.basename(path)


def sweep(sweeps: dict[str, Any], variable: str, path: str, title: str) -> str:
    """Block norms along the sweeps (one panel per model), log-log, with the paper's power for Q,Q."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.2), squeeze=False)
    for ax, (model, s) in zip(axes[0], sweeps.items()):
        x = np.asarray(s.values)
        for (a, b), norms in s.norms.items():
            if a.startswith("W_") and b.startswith("W_") and (a in ("W_Q", "W_K", "W_V") or a == b):
                label = f"({a[2:]},{b[2:]})  slope {s.leading_exponents[a, b]:.1f}"
                ax.plot(x, np.maximum(norms, 1e-300), marker="o", ms=3, label=label)
        claimed = s.claimed.get(("W_Q", "W_Q"))
        if claimed is not None:
            base = s.norms["W_Q", "W_Q"][0] or 1.0
            ax.plot(x, base * (x / x[0]) ** claimed, "k--", lw=1, label=f"paper: (Q,Q) ~ {variable}^{claimed:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("scale c of X" if variable == "c" else "sequence length L")
        ax.set_ylabel("exact ||H[a, b]||_2")
        ax.set_title(model)
        ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.basename(path)
