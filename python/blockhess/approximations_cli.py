"""``blockhess approximations``: the curvature approximations people use, against the exact
Gauss-Newton matrix and Hessian of a whole model (blockhess.approximations).

``--model vit`` (the default) is the ViT of blockhess.experiments (16 tokens of 4 pixels of
scikit-learn's digits, d = 16, d_ff = 64, post-LN blocks with affine norms and biases, learned
positions, a classifier on the mean token), measured under its pooled loss; ``--model lm`` a
GPT-2-shaped language model (pre-LN blocks with affine norms and biases, 2 heads and W_O, GELU,
causal, learned positions, a final norm and an LM head tied to its 16-token embedding, d = 16,
d_ff = 64) on seeded copy sequences of 16 tokens (8 random tokens, then the same 8 again: the
second half is predictable only by attending back), measured under its next-token loss, a loss
term per token. Either with ``--layers`` blocks, trained for ``--steps`` steps of Adam on
blockhess's exact gradient from a seeded initialisation, and measured on ``--batch`` training
samples. It writes ``approximations.md`` (the table, also printed), ``approximations.json`` and
``approximations.png`` (the relative Frobenius error of each approximation against the exact
Gauss-Newton block, per layer and parameter kind) into ``--out``. Bad options are one line
``blockhess approximations: error: ...`` and exit status 2, before anything is computed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

import numpy as np

from . import approximations
from ._command_line import (ArgumentParser, UsageError, check_seed, errors_in_the_data, run_command,
                            writing_outputs)
from ._progress import Progress
from .block import BlockParams, loss_gradient
from .model import ModelSpec
from .spec import BlockSpec

_FILES = ("approximations.md", "approximations.json", "approximations.png")

# The language model's sizes: a vocabulary of 16 tokens, copy sequences of 16, 2,000 of them to train on.
_LM_VOCAB, _LM_TOKENS, _LM_SEQUENCES = 16, 16, 2000


class Task(NamedTuple):
    """A model to measure and what it learns: its parameters at initialisation, its training samples
    and targets, the loss, and how the command names it."""

    params: BlockParams
    train_x: np.ndarray
    train_y: np.ndarray
    loss: str
    title: str


def vit_model(layers: int, seed: int) -> BlockParams:
    """The experiments' ViT with ``layers`` blocks, its weights drawn from ``seed``."""
    from .experiments import vit

    spec = ModelSpec(vit.SPEC, n_layers=layers, patch_dim=vit.FEATURES, n_positions=vit.TOKENS, classes=vit.CLASSES)
    return BlockParams.random(spec, d=vit.D, d_k=vit.D_K, d_ff=vit.D_FF, seed=seed)


def language_model(layers: int, seed: int) -> BlockParams:
    """The GPT-2-shaped language model of the module's docstring with ``layers`` blocks, from ``seed``."""
    block = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                      causal=True)
    spec = ModelSpec(block, n_layers=layers, vocab_size=_LM_VOCAB, n_positions=_LM_TOKENS, lm_head=True,
                     final_norm=True)
    return BlockParams.random(spec, d=16, d_k=8, d_ff=64, seed=seed)


def copy_sequences(count: int, seed: int) -> np.ndarray:
    """``count`` sequences of 8 random tokens followed by the same 8 (int64, (count, 16))."""
    half = np.random.default_rng(seed).integers(0, _LM_VOCAB, size=(count, _LM_TOKENS // 2))
    return np.concatenate([half, half], axis=1)


def task(model: str, layers: int, seed: int) -> Task:
    """The ``model`` ("vit" or "lm") with ``layers`` blocks and its training data, from ``seed``."""
    blocks = f"{layers} block{'s' if layers > 1 else ''}"
    if model == "lm":
        ids = copy_sequences(_LM_SEQUENCES, seed)
        return Task(language_model(layers, seed), ids, ids, "next_token",
                    f"a GPT-2-shaped language model with {blocks} on copy sequences")
    from .experiments import digits

    data = digits.load_digits(seed=seed)
    return Task(vit_model(layers, seed), data.train_x, data.train_y, "pooled_cross_entropy",
                f"the ViT of blockhess.experiments with {blocks}")


def train(t: Task, steps: int, batch: int, seed: int):
    """(X, targets, params): the task's parameters after ``steps`` Adam steps (learning rate 1e-2,
    cosine decay, minibatches of 64 samples) on blockhess's exact gradient, and the first ``batch``
    training samples to measure on."""
    rng = np.random.default_rng(seed)
    params = t.params
    w, m, v = params.flatten(), np.zeros(params.size), np.zeros(params.size)
    for step in range(steps):
        chosen = rng.choice(len(t.train_y), size=64, replace=False)
        g = loss_gradient(t.train_x[chosen], t.train_y[chosen], BlockParams.unflatten(w, params), loss=t.loss)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        lr = 1e-2 * 0.5 * (1 + np.cos(np.pi * step / steps))
        w = w - lr * (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
    return t.train_x[:batch], t.train_y[:batch], BlockParams.unflatten(w, params)


def plot(result: approximations.Comparison, names: tuple[str, ...], path: str) -> None:
    """One heat map per approximation (K-FAC-expand, K-FAC-reduce, the nearest Kronecker product, the
    diagonal): layers (rows) x parameter kinds (columns), the relative Frobenius error against the
    exact Gauss-Newton block; blank where it does not apply."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(approximations.layer_of(n) for n in names))
    kinds = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    shown = ("kfac_expand", "kfac_reduce", "kronecker", "diagonal")
    fig, axes = plt.subplots(2, 2, figsize=(1.5 + 1.1 * len(kinds), 2.4 + 1.0 * len(layers)), squeeze=False)
    for ax, kind in zip(axes.flat, shown):
        table = result.error_table(kind)
        grid = np.full((len(layers), len(kinds)), np.nan)
        for n in names:
            if n in table:
                grid[layers.index(approximations.layer_of(n)), kinds.index(n.rsplit(".", 1)[-1])] = table[n]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(kinds)), kinds, rotation=90)
        ax.set_yticks(range(len(layers)), layers)
        ax.set_title(f"{kind} vs exact Gauss-Newton")
    fig.colorbar(image, ax=list(axes.flat), label="relative Frobenius error")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``blockhess approximations [options]``: 0 done; SystemExit(2) for a bad option or an error in
    the data (one line on stderr), SystemExit(130) when interrupted."""
    return run_command("blockhess approximations", _main, argv)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="blockhess approximations",
        description="Kronecker-factored, diagonal and layer-wise curvature approximations of a ViT or a language "
        "model against its exact Gauss-Newton matrix and Hessian (every cross-layer block), per parameter and for "
        "the whole model.",
    )
    parser.add_argument("--model", default="vit", help="vit: the experiments' ViT on the digits (default); lm: a "
                        "GPT-2-shaped language model on copy sequences")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the model (default 2)")
    parser.add_argument("--batch", type=int, default=64, help="training samples (images or sequences) the "
                        "curvature is taken on (default 64)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps of training first (default 300; 0: at "
                        "the random initialisation)")
    parser.add_argument("--top-k", type=int, default=5, help="the eigenspace whose overlap is measured (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, data split and minibatches (default 0)")
    parser.add_argument("--out", default=os.path.join("build", "approximations"),
                        help="folder for the table, JSON and figure (default build/approximations)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(list(argv))
    try:
        for option, value, least in (("--layers", args.layers, 1), ("--batch", args.batch, 1),
                                     ("--steps", args.steps, 0), ("--top-k", args.top_k, 1)):
            if value < least:
                raise UsageError(f"{option} must be >= {least}, got {value}")
        if args.model not in ("vit", "lm"):
            raise UsageError(f"--model must be vit or lm, got {args.model!r}")
        most = 1437 if args.model == "vit" else _LM_SEQUENCES
        if args.batch > most:
            what = "the digits' training images" if args.model == "vit" else "the training sequences"
            raise UsageError(f"--batch must be <= {most} ({what}), got {args.batch}")
        check_seed(args.seed)
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out}: not a folder")
    except UsageError as err:
        parser.error(str(err))
    progress = Progress(not args.quiet and sys.stderr.isatty())
    start = time.perf_counter()
    with errors_in_the_data(parser, "; try fewer --layers or a smaller --batch"):
        t = task(args.model, args.layers, args.seed)
        progress.start(len(t.params.names) + 4, "blockhess approximations")  # training, then compare's steps
        progress.phase(f"training {t.title}")
        X, labels, params = train(t, args.steps, args.batch, args.seed)
        progress.advance()

        def step(text: str) -> None:
            progress.phase(text)
            progress.advance()

        result = approximations.compare(X, labels, params, loss=t.loss, top_k=args.top_k, progress=step)
        progress.close()
    table = result.to_markdown()
    header = (f"blockhess approximations: {t.title} (P = {params.size}), {args.steps} Adam steps, "
              f"{args.batch} {'images' if args.model == 'vit' else 'sequences'}, seed {args.seed}, "
              f"{time.perf_counter() - start:.0f} s\n\n")
    print(header + table, end="", flush=True)
    with writing_outputs(parser):
        os.makedirs(args.out, exist_ok=True)
        md, js, png = (os.path.join(args.out, f) for f in _FILES)
        with open(md, "w") as fh:
            fh.write(header + table)
        with open(js, "w") as fh:
            fh.write(result.to_json())
        try:
            plot(result, params.names, png)
        except ImportError:
            progress.note("matplotlib is not installed: no figure (pip install 'blockhess[plot]')")
        progress.note(f"wrote {md}, {js} and {png}")
    return 0
