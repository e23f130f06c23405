"""The paper's experiments on the digits ViT of :mod:`.vit`, one function per experiment.

Every Hessian is blockhess's exact closed form of the pooled cross-entropy with respect to all 14 of
the block's parameter matrices and vectors (LayerNorm gamma/beta and biases included, as the paper's
Exp3 LayerNorm figure implies); the embedding and the classifier are not differentiated (the head
stays fixed, as in blockhess's ``loss="pooled_cross_entropy"``).

Each function returns a plain, JSON-serialisable dict and, given ``outdir``, writes its PNG there
(matplotlib, Agg backend) and names the file under ``"figure"``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import block as _block
from ..bounds import running_differences, theorem7_rhs
from ._optional import require
from .digits import load_digits
from .vit import FULL, QUICK, Problem, accuracy, export, init_vit, train

LOSS = "pooled_cross_entropy"


# ---- Hessians -------------------------------------------------------------------------------------


def loss_hessian(problem: Problem) -> np.ndarray:
    """The exact (P, P) loss Hessian over every block parameter, in ``problem.params.names`` order."""
    return _block.loss_hessian(problem.X, problem.labels, problem.params, loss=LOSS, head=problem.head)


def _spectral(symmetric: np.ndarray) -> float:
    return float(np.abs(np.linalg.eigvalsh(symmetric)).max())


def diagonal_block_norms(problem: Problem, hessian: np.ndarray | None = None) -> dict[str, dict[str, float]]:
    """{"spectral": {name: ||H[i,i]||_2}, "frobenius": {name: ||H[i,i]||_F}}. Without a dense
    ``hessian``, each diagonal block alone (``wrt=(name,)``: far cheaper than the whole H)."""
    norms: dict[str, dict[str, float]] = {"spectral": {}, "frobenius": {}}
    with _one_blas_thread():
        for name, where in problem.params.slices().items():
            if hessian is None:
                block = _block.loss_hessian(problem.X, problem.labels, problem.params, loss=LOSS,
                                            head=problem.head, wrt=(name,))
            else:
                block = hessian[where, where]
            norms["spectral"][name] = _spectral(block)
            norms["frobenius"][name] = float(np.linalg.norm(block))
    return norms


def _one_blas_thread():
    """On a busy machine OpenBLAS's spinning threads made eigvalsh 3x slower than one thread."""
    return require("threadpoolctl").threadpool_limits(limits=1, user_api="blas")


# ---- figures --------------------------------------------------------------------------------------


def _figure(figsize: tuple[float, float]):
    """A matplotlib Figure drawn by Agg, without pyplot: no window, and the caller's pyplot backend
    and open figures stay as they are."""
    return require("matplotlib.figure").Figure(figsize=figsize, layout="constrained")


def _save(figure, outdir: str | Path, filename: str) -> str:
    Path(outdir).mkdir(parents=True, exist_ok=True)
    figure.savefig(Path(outdir) / filename, dpi=110, bbox_inches="tight")
    return filename


def _label_groups(params) -> list[tuple[float, str]]:
    """(centre, label) along a Hessian axis; runs of adjacent small blocks (the biases and LayerNorm
    vectors, 16 entries against W_1's 1,024) share one label, "b_V/gamma_1/beta_1", so none overlap."""
    groups: list[tuple[int, int, list[str]]] = []  # (start, stop, names)
    was_small = False
    for name, where in params.slices().items():
        small = where.stop - where.start < params.size / 50
        if small and was_small:
            start, _, names = groups.pop()
            groups.append((start, where.stop, names + [name]))
        else:
            groups.append((where.start, where.stop, [name]))
        was_small = small
    return [((start + stop) / 2, "/".join(names)) for start, stop, names in groups]


def _block_axes(ax, params) -> None:
    """Block boundaries as lines and the block names at the blocks' centres, on both axes."""
    for where in list(params.slices().values())[:-1]:
        ax.axhline(where.stop - 0.5, color="white", lw=0.5)
        ax.axvline(where.stop - 0.5, color="white", lw=0.5)
    centres, labels = zip(*_label_groups(params))
    ax.set_xticks(centres, labels, rotation=90, fontsize=7)
    ax.set_yticks(centres, labels, fontsize=7)


# ---- Exp1: the Hessian's entries at initialisation and after training ------------------------------


def _max_pool(a: np.ndarray, f: int) -> np.ndarray:
    """The largest entry of each f x f cell of a square array whose side f divides."""
    n = a.shape[0] // f
    return a.reshape(n, f, n, f).max(axis=(1, 3))


def _block_max_abs(hessian: np.ndarray, params) -> np.ndarray:
    slices = list(params.slices().values())
    return np.array([[np.abs(hessian[a, b]).max() for b in slices] for a in slices])


def exp1_heatmaps(initial: Problem, trained: Problem, *, hessians: tuple[np.ndarray, np.ndarray] | None = None,
                  outdir: str | Path | None = None) -> dict[str, Any]:
    """log10|H| heat maps of the whole block Hessian at initialisation and after training (the
    paper's Figures 3 and 4), on the same batch. ``hessians``: the two dense Hessians, if already
    computed. Returns each diagonal block's largest |entry|, the 14 x 14 table of every block's
    largest |entry|, and the block with the largest entry, at both points."""
    H_init, H_trained = hessians if hessians is not None else (loss_hessian(initial), loss_hessian(trained))
    params = trained.params
    result: dict[str, Any] = {
        "batch": int(len(trained.labels)),
        "names": list(params.names),
        "slices": [[s.start, s.stop] for s in params.slices().values()],
    }
    for when, H in (("init", H_init), ("trained", H_trained)):
        table = _block_max_abs(H, params)
        i, j = np.unravel_index(table.argmax(), table.shape)
        result[f"max_abs_{when}"] = {name: float(table[k, k]) for k, name in enumerate(params.names)}
        result[f"block_max_abs_{when}"] = table.tolist()
        result[f"largest_block_{when}"] = [params.names[i], params.names[j], float(table[i, j])]
    if outdir is not None:
        # Each pixel shows the largest |entry| of a 4 x 4 cell: a panel is ~700 pixels wide, and
        # pooling keeps every large entry visible where resampling would drop 15 of 16 (and is faster).
        pool = 4 if params.size % 4 == 0 else 1
        logs = [np.log10(_max_pool(np.abs(H), pool) + np.finfo(float).tiny) for H in (H_init, H_trained)]
        top = max(float(log.max()) for log in logs)
        extent = (-0.5, params.size - 0.5, params.size - 0.5, -0.5)  # axes in parameter indices
        figure = _figure((15, 7))
        axes = figure.subplots(1, 2)
        for ax, log, title in zip(axes, logs, ("at initialisation", "after training")):
            image = ax.imshow(log, cmap="viridis", vmin=top - 10, vmax=top, interpolation="nearest", extent=extent)
            _block_axes(ax, params)
            ax.set_title(f"log10 |H| {title} (batch of {result['batch']}, {pool}x{pool} max-pooled)")
        figure.colorbar(image, ax=axes, shrink=0.8, label="log10 |Hessian entry|")
        figure.suptitle("Exp1: exact loss Hessian of the digits ViT block, every parameter block")
        result["figure"] = _save(figure, outdir, "exp1_hessian_heatmaps.png")
        result["figure_blocks"] = _plot_block_table(result, outdir)
    return result


def _plot_block_table(result: dict[str, Any], outdir: str | Path) -> str:
    """The 14 x 14 table of each block's largest |entry| (log10), where every name is legible."""
    names = result["names"]
    tables = [np.log10(np.asarray(result[f"block_max_abs_{when}"]) + np.finfo(float).tiny)
              for when in ("init", "trained")]
    top = max(float(t.max()) for t in tables)
    figure = _figure((13, 6))
    axes = figure.subplots(1, 2)
    for ax, table, title in zip(axes, tables, ("at initialisation", "after training")):
        image = ax.imshow(table, cmap="viridis", vmin=top - 6, vmax=top)
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(f"largest |H entry| of each block, {title}")
    figure.colorbar(image, ax=axes, shrink=0.8, label="log10 max |Hessian entry| in the block")
    zero = [name for name, row in zip(names, result["block_max_abs_trained"]) if not any(row)]
    note = f" ({', '.join(zero)}: exactly 0, a row's softmax ignores a shift of all its scores)" if zero else ""
    figure.suptitle(f"Exp1: block by block{note}")
    return _save(figure, outdir, "exp1_block_max.png")


# ---- Exp2: parameter-block and Hessian-block norms -------------------------------------------------


def exp2_norms(problem: Problem, *, hessian: np.ndarray | None = None,
               outdir: str | Path | None = None) -> dict[str, Any]:
    """Frobenius norms of the parameter blocks and spectral and Frobenius norms of the diagonal
    Hessian blocks H[i,i] on one batch (the paper's Figure 5: 128 training samples)."""
    params = problem.params
    result: dict[str, Any] = {
        "batch": int(len(problem.labels)),
        "parameter_frobenius": {name: float(np.linalg.norm(params[name])) for name in params.names},
    }
    norms = diagonal_block_norms(problem, hessian)
    result["hessian_spectral"], result["hessian_frobenius"] = norms["spectral"], norms["frobenius"]
    if outdir is not None:
        x = np.arange(len(params.names))
        figure = _figure((14, 4.5))
        left, right = figure.subplots(1, 2)
        left.bar(x, list(result["parameter_frobenius"].values()), color="tab:gray")
        left.set_title("parameter blocks")
        left.set_ylabel("Frobenius norm")
        right.bar(x - 0.2, list(norms["spectral"].values()), 0.4, label="spectral ||H_ii||_2")
        right.bar(x + 0.2, list(norms["frobenius"].values()), 0.4, label="Frobenius ||H_ii||_F")
        right.set_yscale("log")
        for k, value in enumerate(norms["spectral"].values()):
            if value == 0:  # no bar on a log axis
                right.annotate("0", (k, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom")
        right.set_title(f"diagonal Hessian blocks (batch of {result['batch']})")
        right.set_ylabel("norm")
        right.legend()
        for ax in (left, right):
            ax.set_xticks(x, params.names, rotation=60, fontsize=8)
            ax.set_xlabel("block")
        figure.suptitle("Exp2: norms of the trained digits ViT block")
        result["figure"] = _save(figure, outdir, "exp2_norms.png")
    return result


# ---- Exp3: Hessian norms over the first training steps ---------------------------------------------


class DynamicsRecorder:
    """A ``vit.train`` callback: every ``every`` steps up to ``until``, the diagonal Hessian blocks'
    norms on a fixed batch (patches, labels)."""

    def __init__(self, patches: np.ndarray, labels: np.ndarray, *, every: int, until: int) -> None:
        self.patches, self.labels, self.every, self.until = patches, labels, every, until
        self.steps: list[int] = []
        self.spectral: dict[str, list[float]] = {}
        self.frobenius: dict[str, list[float]] = {}

    def __call__(self, step: int, model: dict[str, Any]) -> None:
        if step > self.until or step % self.every:
            return
        norms = diagonal_block_norms(export(model, self.patches, self.labels))
        self.steps.append(step)
        for name in norms["spectral"]:
            self.spectral.setdefault(name, []).append(norms["spectral"][name])
            self.frobenius.setdefault(name, []).append(norms["frobenius"][name])


def exp3_dynamics(recorder: DynamicsRecorder, *, outdir: str | Path | None = None) -> dict[str, Any]:
    """The recorded per-block Hessian norms against the training step (Appendix A.1)."""
    result: dict[str, Any] = {"batch": int(len(recorder.labels)), "steps": list(recorder.steps),
                              "spectral": dict(recorder.spectral), "frobenius": dict(recorder.frobenius)}
    if outdir is not None:
        figure = _figure((9, 5.5))
        ax = figure.subplots()
        colours = require("matplotlib").colormaps["tab20"]
        for k, (name, values) in enumerate(recorder.spectral.items()):
            vector = name.startswith(("b_", "gamma", "beta"))  # dashed: biases and LayerNorm vectors
            label = name if any(values) else f"{name} (identically 0)"
            ax.plot(recorder.steps, values, "--" if vector else "-", marker=".", color=colours(k % 20), label=label)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("spectral norm ||H_ii||_2")
        ax.set_title(f"Exp3: diagonal Hessian blocks during training (batch of {result['batch']})")
        ax.legend(ncol=2, fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
        result["figure"] = _save(figure, outdir, "exp3_dynamics.png")
    return result


# ---- Exp5: the loss difference |L_{k+1} - L_k| at the trained weights ------------------------------


def per_sample_losses(problem: Problem) -> np.ndarray:
    """l_i: each sample's pooled cross-entropy, from blockhess's forward pass of the whole batch."""
    Z = _block.block_forward(problem.X, problem.params)
    W_C, b_C = problem.head
    logits = Z.mean(axis=1) @ W_C + b_C
    top = logits.max(axis=1, keepdims=True)  # a stable log-sum-exp
    log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return log_norm - logits[np.arange(len(problem.labels)), problem.labels]


def _ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """e_0 = v_0, e_k = alpha v_k + (1 - alpha) e_{k-1}: a first-order recursive filter."""
    signal = require("scipy.signal")
    smoothed, _ = signal.lfilter([alpha], [1.0, alpha - 1.0], values, zi=[(1.0 - alpha) * values[0]])
    return smoothed


def exp5_loss_difference(problem: Problem, *, alpha: float = 0.05,
                         outdir: str | Path | None = None) -> dict[str, Any]:
    """At the trained weights: the running mean L_k of the per-sample losses over the samples in
    ``problem``'s order, |L_{k+1} - L_k| against k on log-log axes with its EMA and a least-squares
    log-log slope, beside Thm 7's stated and corrected right-hand sides (Figure 6)."""
    losses = per_sample_losses(problem)
    k, difference = running_differences(losses)  # |L_{k+1} - L_k| for k = 1 .. N-1
    # At w = w* the Hessian term of Thm 7 vanishes (M ||w - w*||^2 = 0).
    rhs = theorem7_rhs(k, float(losses.max()), M=0.0, distance=0.0)
    positive = difference > 0  # the log of an exact tie is -inf
    slope, intercept = np.polyfit(np.log(k[positive]), np.log(difference[positive]), 1)
    ema = _ema(difference, alpha)
    result: dict[str, Any] = {
        "samples": int(len(losses)), "loss_max": float(losses.max()), "loss_mean": float(losses.mean()),
        "slope": float(slope), "intercept": float(intercept), "alpha": alpha,
        "max_ratio_to_corrected": float((difference / rhs["corrected"]).max()),
        "k": k.tolist(), "difference": difference.tolist(), "ema": ema.tolist(),
        "stated": np.asarray(rhs["stated"]).tolist(), "corrected": np.asarray(rhs["corrected"]).tolist(),
    }
    if outdir is not None:
        figure = _figure((8, 5.5))
        ax = figure.subplots()
        ax.loglog(k, difference, ".", color="tab:gray", ms=2, alpha=0.5, label="|L_{k+1} - L_k|")
        ax.loglog(k, ema, color="tab:blue", label=f"EMA (alpha = {alpha})")
        ax.loglog(k, np.exp(intercept) * k**slope, "--", color="black", label=f"log-log fit, slope {slope:.2f}")
        ax.loglog(k, rhs["stated"], color="tab:red", label="Thm 7 as stated, 2 L_max/(k+1)")
        ax.loglog(k, rhs["corrected"], color="tab:orange", label="Thm 7 corrected, L_max/(k+1)")
        ax.set_xlabel("k (training samples seen)")
        ax.set_ylabel("|L_{k+1} - L_k| at the trained weights")
        ax.set_title("Exp5: loss-landscape convergence on the digits")
        ax.legend(fontsize=8)
        result["figure"] = _save(figure, outdir, "exp5_loss_difference.png")
    return result


# ---- everything -----------------------------------------------------------------------------------


def run_experiments(outdir: str | Path, *, quick: bool = False, progress: Callable[[str], None] | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """Train the digits ViT once (recording Exp3 on the way), run Exp1, Exp2, Exp3 and Exp5, write
    their PNGs into ``outdir`` and return every result. ``quick``: fewer training steps, a batch of
    32 rather than 128 for the Hessians and fewer Exp3 records (for tests)."""
    with _one_blas_thread():
        return _run(outdir, quick, progress, seed)


def _run(outdir, quick, progress, seed):
    say = progress if progress is not None else (lambda message: None)
    started = time.perf_counter()
    say("loading the digits")
    data = load_digits(seed=seed)
    settings = QUICK if quick else FULL
    batch = np.random.default_rng(seed).choice(len(data.train_y), 32 if quick else 128, replace=False)
    patches, labels = data.train_x[batch], data.train_y[batch]
    model = init_vit(seed)
    initial = export(model, patches, labels)
    say("Exp1: the Hessian at initialisation")
    H_init = loss_hessian(initial)
    recorder = DynamicsRecorder(patches, labels, every=10 if quick else 50, until=30 if quick else 1000)
    say(f"training {settings.steps} steps (recording Exp3 up to step {recorder.until})")
    training = train(model, data.train_x, data.train_y, settings, seed=seed, callback=recorder, progress=progress)
    training["test_accuracy"] = accuracy(model, data.test_x, data.test_y)
    training["train_accuracy"] = accuracy(model, data.train_x, data.train_y)
    trained = export(model, patches, labels)
    say("Exp1: the Hessian after training")
    H_trained = loss_hessian(trained)
    results: dict[str, Any] = {"exp1": exp1_heatmaps(initial, trained, hessians=(H_init, H_trained), outdir=outdir)}
    say("Exp2: norms")
    results["exp2"] = exp2_norms(trained, hessian=H_trained, outdir=outdir)
    results["exp3"] = exp3_dynamics(recorder, outdir=outdir)
    say("Exp5: the loss difference over the training samples")
    results["exp5"] = exp5_loss_difference(export(model, data.train_x, data.train_y), outdir=outdir)
    results["training"] = training
    results["figures"] = {name: results[name]["figure"] for name in ("exp1", "exp2", "exp3", "exp5")}
    results["figures"]["exp1_blocks"] = results["exp1"]["figure_blocks"]
    results["seconds"] = time.perf_counter() - started
    say(f"done in {results['seconds']:.1f} s")
    return results
