"""``blockhess spectrum``: the curvature of a block's loss without the dense Hessian: per parameter
block the exact trace (from the factors) and the extreme eigenvalues, for the whole block the top
and bottom eigenvalues (Lanczos through the exact H v) and, with ``--density``, the spectral density
by stochastic Lanczos quadrature.

The block is given by its sizes and spec options (as for ``blockhess check``, random seeded weights,
input and target), or by ``--module FILE``: an ``nn.Module`` saved with ``torch.save``, imported
with :func:`blockhess.from_torch`. Bad options are one line ``blockhess spectrum: error: ...`` and
exit status 2, before anything is computed.
"""

from __future__ import annotations

import json
import math
import textwrap
import sys
import time
from typing import Any

import numpy as np

from . import _command_files, _working_memory
from ._check_config import Config, add_block_options, block_params, config_from_args, make_problem, validate_block
from ._check_memory import available_memory, memory_budget, parameter_count
from ._command_line import (ArgumentParser, UsageError, attach_negative_numbers, check_outputs, check_plot_format,
                            errors_in_the_data, raised_by_blockhess, run_command, writing_outputs)
from ._config import format_bytes
from ._errors import OutputTooLargeError
from ._threads import get_num_threads
from .block import BlockParams
from .hvp import hessian_operator
from .spec import BlockSpec
from .spectrum import arpack_memory

# Blocks this small get their spectrum from the dense block (k < n is ARPACK's rule).
_DENSE_BLOCK = 256
# ||H[a, a]||_F costs one product per parameter of the block (there is no factor-only form): beyond
# this many it is left out (null in --json).
_FROBENIUS_PRODUCTS = 4096


class _Counter:
    """Counts the operator's products for the progress bar (tqdm on a terminal, else nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                return
            self.bar = tqdm(desc="Lanczos products", unit="Hv", file=sys.stderr, leave=False)

    def __call__(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _counted(op, counter):
    """The operator with every product counted (a view: same shape, dtype and methods)."""
    product = op._product

    def counted(V):
        counter()
        return product(V)

    op._product = counted
    return op


def _block_traces(op, X, target, params, kw) -> dict[str, float | None]:
    """The exact trace of every parameter block: from the whole operator's diagonal (formed one
    node's parameters at a time, an attention node's sharing their factors), else block by block
    where that exceeds the memory budget; None for a block whose own factors exceed it
    (BLOCKHESS_MEMORY_BUDGET raises it)."""
    try:
        return {a: trace for (a, _), trace in op.trace(by_block=True).items()}
    except OutputTooLargeError:
        pass
    traces: dict[str, float | None] = {}
    for name in params.names:
        try:
            traces[name] = hessian_operator(X, target, params, wrt=(name,), **kw).trace()
        except OutputTooLargeError:
            traces[name] = None
    return traces


def _block_extremes(op, counter) -> tuple[float, float, float | None]:
    """(smallest, largest) eigenvalue and the Frobenius norm (None for a large block) of an operator
    over one parameter block."""
    n = op.shape[0]
    if n <= _DENSE_BLOCK:
        dense = np.asarray(op.matmat(np.eye(n, dtype=op.dtype)), dtype=np.float64)
        values = np.linalg.eigvalsh(0.5 * (dense + dense.T))
        return float(values[0]), float(values[-1]), float(np.linalg.norm(dense))
    _counted(op, counter)
    top = op.eigsh(k=1, which="LA", tol=1e-6, return_eigenvectors=False)
    bottom = op.eigsh(k=1, which="SA", tol=1e-6, return_eigenvectors=False)
    frobenius = op.frobenius_norm() if n <= _FROBENIUS_PRODUCTS else None
    return float(bottom[0]), float(top[0]), frobenius


def _module_config(cfg: Config, imported: BlockParams) -> Config:
    """The configuration whose seeded input and target go with an imported block: its sizes, dtype and
    eps, the command's tokens, samples, loss and seed."""
    return Config(L=cfg.L, d=imported.d, d_k=max(imported.d_k, 1), d_ff=imported.d_ff, batch=cfg.batch,
                  loss=cfg.loss, dtype=str(imported.dtype), seed=cfg.seed, eps=imported.spec.eps,
                  classes=cfg.classes)


def _problem(cfg: Config, imported: BlockParams | None):
    """(X, target, params, head) from the sizes and options, or for a block imported with --module."""
    if imported is None:
        X, target, weights, head = make_problem(cfg)
        return X, target, block_params(weights, cfg), head
    X, target, _, head = make_problem(_module_config(cfg, imported))
    return X, target, imported, head


def run(cfg: Config, *, imported: BlockParams | None = None, k: int = 5, probes: int = 10, steps: int = 60,
        density: bool = False, progress: bool = False) -> dict[str, Any]:
    """Everything the command reports, as a dict (the --json output); ``imported``: the block of
    --module (:func:`import_module`)."""
    counter = _Counter(progress)
    try:
        X, target, params, head = _problem(cfg, imported)
        eps = cfg.eps if imported is None else params.spec.eps
        kw = dict(loss=cfg.loss, eps=eps, head=head)
        op = _counted(hessian_operator(X, target, params, **kw), counter)
        t0 = time.perf_counter()
        traces = _block_traces(op, X, target, params, kw)
        t_trace = time.perf_counter() - t0
        blocks = []
        for name in params.names:
            block_op = hessian_operator(X, target, params, wrt=(name,), **kw)
            low, high, frobenius = _block_extremes(block_op, counter)
            blocks.append({"block": name, "size": params.sizes[params.names.index(name)],
                           "trace": traces[name], "frobenius": frobenius,
                           "min_eigenvalue": low, "max_eigenvalue": high})
        P = op.shape[0]
        kk = min(k, P - 1)
        t0 = time.perf_counter()
        top = op.eigsh(k=kk, which="LA", tol=1e-6, return_eigenvectors=False) if kk >= 1 else np.array([])
        bottom = op.eigsh(k=kk, which="SA", tol=1e-6, return_eigenvectors=False) if kk >= 1 else np.array([])
        t_eig = time.perf_counter() - t0
        result = {
            "block": cfg.describe() if imported is None else repr(params.spec),
            "P": P, "loss": cfg.loss, "dtype": str(op.dtype), "loss_value": op.loss_value,
            "trace": None if any(b["trace"] is None for b in blocks) else float(sum(b["trace"] for b in blocks)),
            "blocks": blocks,
            "top_eigenvalues": [float(v) for v in top], "bottom_eigenvalues": [float(v) for v in bottom],
            "seconds": {"traces": t_trace, "eigenvalues": t_eig},
        }
        if density:
            sd = op.spectral_density(probes=probes, steps=steps)
            result["density"] = {"grid": sd.grid.tolist(), "density": sd.density.tolist(), "probes": probes,
                                 "steps": steps, "sigma": sd.sigma, "moments": [sd.moment(1), sd.moment(2)]}
        return result
    finally:
        counter.close()


def format_report(r: dict[str, Any]) -> str:
    lines = [f"blockhess spectrum: {r['block']}, P = {r['P']}, loss = {r['loss']} ({r['loss_value']:.6g}), {r['dtype']}",
             "",
             f"{'block':<10} {'size':>9} {'trace':>12} {'||H||_F':>12} {'min eig':>12} {'max eig':>12}"]
    number = lambda v: "n/a" if v is None else f"{v:.4e}"  # noqa: E731
    for b in r["blocks"]:
        lines.append(f"{b['block']:<10} {b['size']:>9} {number(b['trace']):>12} {number(b['frobenius']):>12} "
                     f"{b['min_eigenvalue']:12.4e} {b['max_eigenvalue']:12.4e}")
    fmt = lambda values: ", ".join(f"{v:.4e}" for v in values)  # noqa: E731
    if any(b["frobenius"] is None for b in r["blocks"]):
        lines.append(f"(||H||_F: n/a for blocks of more than {_FROBENIUS_PRODUCTS} parameters: it costs one "
                     "product per parameter)")
    if any(b["trace"] is None for b in r["blocks"]):
        lines.append("(trace: n/a where the block's factors exceed the memory budget; raise it with "
                     "BLOCKHESS_MEMORY_BUDGET)")
    whole = "n/a" if r["trace"] is None else f"{r['trace']:.6e}"
    lines += ["",
              f"whole block: trace {whole} (exact, from the factors, {r['seconds']['traces']:.2f} s)",
              f"top eigenvalues:    {fmt(r['top_eigenvalues'])}",
              f"bottom eigenvalues: {fmt(r['bottom_eigenvalues'])}  ({r['seconds']['eigenvalues']:.2f} s, Lanczos)"]
    if "density" in r:
        m1, m2 = r["density"]["moments"]
        lines.append(f"spectral density: {r['density']['probes']} probes x {r['density']['steps']} Lanczos steps, "
                     f"sigma {r['density']['sigma']:.3g}; tr(H)/P ~ {m1:.4e}, tr(H^2)/P ~ {m2:.4e}")
    return "\n".join(lines)


def plot_density(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid, density = np.asarray(r["density"]["grid"]), np.asarray(r["density"]["density"])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=130)
    floor = max(density.max() * 1e-8, np.finfo(np.float64).tiny)
    ax.semilogy(grid, np.maximum(density, floor), lw=1.2)
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density (log scale)")
    title = f"Hessian spectral density (SLQ), P = {r['P']:,}: {r['block']}"
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def import_module(path: str) -> BlockParams:
    """The block of an ``nn.Module`` saved with torch.save, through blockhess.from_torch; UsageError
    (one line) for a file that is missing or unreadable, that torch cannot load, or whose module
    from_torch does not take."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("--module needs PyTorch (pip install 'torch==2.13.0')") from None
    from .from_torch import from_torch

    try:
        module = _command_files.load_module(path, "--module")
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        params = from_torch(module)[1]
        spec = params.spec
        if spec.reads_tokens or spec.patch_dim:  # their inputs are token ids or patches, not the command's X
            raise UsageError(f"--module {path}: a {'language model' if spec.reads_tokens else 'ViT'}, which this "
                             "command does not set up inputs for yet; use blockhess check --model, or "
                             "blockhess.hessian_operator(...).eigsh in Python")
        return params
    except (ValueError, TypeError) as err:
        if not raised_by_blockhess(err):
            raise
        raise UsageError(f"--module {path}: {err}") from None


def _block_shape(cfg: Config, imported: BlockParams | None) -> tuple[list[int], BlockSpec, tuple[int, int, int, int]]:
    """(each parameter block's size, the spec, (d, d_k, d_v, d_ff)) of the block studied, known before
    it is made."""
    if imported is None:
        return [math.prod(shape) for _, shape in cfg.parameters()], cfg.spec, cfg.dims
    return list(imported.sizes), imported.spec, (imported.d, imported.d_k, imported.d_v, imported.d_ff)


def _memory_need(cfg: Config, imported: BlockParams | None, k: int, steps: int, density: bool) -> int:
    """Bytes that :func:`run` holds at its peak, over-counted on purpose: the seeded problem (drawn in
    float64, cast to the dtype and copied into the block's parameters and the operator), the whole
    block's operator and one parameter block's at once (the core's estimate of products, one in
    flight per thread), and the largest of the eigenvalue solvers' and the density's Lanczos vectors.
    The traces' diagonals are left out: one that does not fit is reported as n/a."""
    drawn = cfg if imported is None else _module_config(cfg, imported)
    itemsize = np.dtype(drawn.dtype).itemsize
    B, L, d = drawn.batch, drawn.L, drawn.d
    sizes, spec, dims = _block_shape(cfg, imported)
    P = sum(sizes)
    problem = 3 * 8 * (2 * B * L * d + parameter_count(drawn) + (d + 1) * cfg.classes)
    threads = get_num_threads()
    operators = 2 * _working_memory.model(spec, dims, B, L, itemsize, "products", loss=cfg.loss,
                                          head_classes=cfg.classes if cfg.pooled else 0, columns=threads)
    kk = min(k, P - 1)
    solvers = [arpack_memory(P, kk)]
    if density:
        solvers.append(8 * P * (min(steps, P) + 4))  # blockhess.spectrum.lanczos keeps every step's vector
    for n in sizes:
        if n <= _DENSE_BLOCK:  # the identity, its products, their float64 and symmetrised copies
            solvers.append(4 * 8 * n * n)
        else:
            solvers.append(arpack_memory(n, 1))
            if n <= _FROBENIUS_PRODUCTS:  # frobenius_norm: at most 32 MiB of identity columns, their products
                solvers.append(min(n * n, (32 << 20) // itemsize) * (2 * itemsize + 8))
    return problem + operators + max(solvers)


def _check_memory(cfg: Config, imported: BlockParams | None, k: int, steps: int, density: bool) -> None:
    """UsageError when the run would exceed the memory budget or what the machine has: before anything
    is allocated."""
    budget = memory_budget()
    need = _memory_need(cfg, imported, k, steps, density)
    if imported is None:
        block = f"--L {cfg.L} --d {cfg.d} --d-k {cfg.d_k} --d-ff {cfg.d_ff}"
    else:
        block = f"--L {cfg.L} with the imported {imported!r}"
    asked = (f"{block}{f' --batch {cfg.batch}' if cfg.batch > 1 else ''} gives "
             f"P = {sum(_block_shape(cfg, imported)[0])} parameters")
    smaller = f"use smaller sizes{' or fewer --steps' if density else ''}"
    if need > budget:
        raise UsageError(
            f"{asked}: the spectrum needs about {format_bytes(need)}, more than the memory budget of "
            f"{format_bytes(budget)}; {smaller}, or raise BLOCKHESS_MEMORY_BUDGET "
            f"(e.g. BLOCKHESS_MEMORY_BUDGET={math.ceil(need / 2**30)}GiB)")
    available = available_memory()
    if available is not None and need > available:
        raise UsageError(
            f"{asked}: the spectrum needs about {format_bytes(need)} of memory, but only "
            f"{format_bytes(available)} is available on this machine; {smaller}")


def validate(cfg: Config, args: Any) -> BlockParams | None:
    """Refuse every bad option before anything is computed or allocated (UsageError, one line);
    returns the block of --module (None without it)."""
    validate_block(cfg)
    for option, value in (("-k", args.k), ("--probes", args.probes), ("--steps", args.steps)):
        if value < 1:
            raise UsageError(f"{option} must be >= 1, got {value}")
    check_outputs({"--json": args.json, "--density": args.density})
    if args.density is not None:
        check_plot_format(args.density, "--density")
    imported = None if args.module is None else import_module(args.module)
    _check_memory(cfg, imported, args.k, args.steps, args.density is not None)
    return imported


def main(argv: list[str]) -> int:
    """``blockhess spectrum [options]``: 0 done; SystemExit(2) for a bad option or an error in the
    data (one line on stderr), SystemExit(130) when interrupted."""
    return run_command("blockhess spectrum", _main, argv)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="blockhess spectrum",
        description="Per-block exact traces and extreme eigenvalues, and the whole block's top and bottom "
        "eigenvalues and spectral density, of a Transformer block's loss Hessian, without the dense matrix.",
    )
    add_block_options(parser)
    parser.add_argument("--module", metavar="FILE", help="an nn.Module saved with torch.save (imported with "
                        "blockhess.from_torch; its sizes and options replace the ones above, --L sets the tokens)")
    parser.add_argument("-k", type=int, default=5, help="top and bottom eigenvalues of the whole block (default 5)")
    parser.add_argument("--density", metavar="FILE.png", help="draw the spectral density (needs matplotlib)")
    parser.add_argument("--probes", type=int, default=10, help="SLQ probes for --density (default 10)")
    parser.add_argument("--steps", type=int, default=60, help="Lanczos steps per probe (default 60)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(attach_negative_numbers(list(argv)))
    cfg = config_from_args(args)
    try:
        imported = validate(cfg, args)
    except UsageError as err:
        parser.error(str(err))
    with errors_in_the_data(parser):
        result = run(cfg, imported=imported, k=args.k, probes=args.probes, steps=args.steps,
                     density=args.density is not None, progress=not args.quiet and sys.stderr.isatty())
    print(format_report(result), flush=True)
    with writing_outputs(parser):
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        if args.density:
            plot_density(result, args.density)
    return 0
