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

import json
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from . import _backend, _check_config, _check_references
from ._check_comparison import (HVP_TOLERANCE, HVP_VECTORS, NOISE_MULTIPLE, SPLIT_TOLERANCE, TOLERANCE, fro,
                                fro_of_difference, fro_of_split_residual, max_asymmetry, rounding_noise,
                                smallest_layernorm_sigma, spectral_norm)
from ._check_config import Config, add_block_options, block_params, config_from_args, validate_block
from ._check_memory import check_memory
from ._check_model import GPT2_CONFIGS, check_model, format_model_report, load_model
from ._check_references import resolve_reference
from ._check_report import BlockReport, Report, format_report, plot_heatmap
from ._command_line import (ArgumentParser, UsageError, attach_negative_numbers, check_outputs,
                            check_plot_format, errors_in_the_data, run_command, writing_outputs)
from ._progress import Progress
from .block import loss_hessian, loss_value
from .hvp import hessian_operator


def _to_device(arrays, device):
    if device == "cpu":
        return arrays
    import cupy

    return [cupy.asarray(a) for a in arrays]


def run_check(cfg: Config, progress: Progress | None = None) -> tuple[Report, dict[str, Any]]:
    """Compute, verify and summarise; returns the report and the arrays (for plotting)."""
    bar = progress if progress is not None else Progress(False)
    reference = resolve_reference(cfg.reference)
    X, target, weights, head = _check_config.make_problem(cfg)
    Xd, *wd = _to_device([X, *weights], cfg.device)
    target_d = _to_device([target], cfg.device)[0]  # class indices too: no host/device mixing
    params = block_params(wd, cfg)
    P = params.size
    slices = params.slices()
    pairs = [(a, b) for i, a in enumerate(params.names) for b in params.names[i:]]
    closed_form = f"closed form, P = {P} ({cfg.device}, {cfg.dtype})"
    bar.start(7 + (2 if reference == "torch" else P) + len(pairs), closed_form)
    bar.phase(closed_form)
    kwargs = dict(loss=cfg.loss, eps=cfg.eps, head=None if head is None else tuple(_to_device(list(head), cfg.device)))
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
    outer = _backend.to_host(loss_hessian(Xd, target_d, params, part="outer", **kwargs))
    bar.advance()
    functional = _backend.to_host(loss_hessian(Xd, target_d, params, part="functional", **kwargs))
    bar.advance()
    full = _backend.to_host(full)
    value = float(loss_value(Xd, target_d, params, **kwargs))
    bar.phase("matrix-free H v")
    hvp = _check_hvp(X, target, weights, full, cfg, head)  # the engine's products, on the host arrays
    bar.advance()

    if reference == "torch":
        bar.phase("reference: torch.func.hessian")
        H_ref, t_ref = _check_references.torch_reference(X, target, weights, cfg, bar, head)
    else:
        bar.phase("reference: finite differences")
        H_ref, t_ref = _check_references.finite_difference_reference(
            X, target, block_params(weights, cfg), cfg, bar, head)

    # Tolerances with an absolute floor (see NOISE_MULTIPLE): error <= tol * max(||ref||, floor).
    tolerance = TOLERANCE[(reference, cfg.dtype)]
    sigma_min = smallest_layernorm_sigma(X, weights, cfg)
    noise = NOISE_MULTIPLE * rounding_noise(P, value, sigma_min, cfg.dtype, reference)  # = tolerance * floor
    floor = noise / tolerance
    ref_norm = fro(H_ref)

    bar.phase("per-block norms and errors")
    blocks = []
    for a, b in pairs:
        sa, sb = slices[a], slices[b]
        blk = full[sa, sb]
        ref_blk = H_ref[sa, sb]
        denominator = max(fro(ref_blk), 1e-4 * ref_norm)  # blocks that vanish: measured against the whole
        abs_err = fro_of_difference(blk, ref_blk)
        blocks.append(BlockReport(
            block=f"{a}-{b}", shape=tuple(blk.shape),
            spectral_norm=spectral_norm(blk),
            outer_fro=fro(outer[sa, sb]),
            functional_fro=fro(functional[sa, sb]),
            rel_error=abs_err / denominator if denominator > noise else None,
            abs_error=abs_err,
            ok=abs_err <= tolerance * max(denominator, floor),
        ))
        bar.advance()
    abs_error = fro_of_difference(full, H_ref)
    full_norm = fro(full)
    split_residual = fro_of_split_residual(outer, functional, full)
    split_tol = SPLIT_TOLERANCE[cfg.dtype]
    split_noise = NOISE_MULTIPLE * rounding_noise(P, value, sigma_min, cfg.dtype, "torch")
    best = min(times)
    # perf_counter cannot return 0 for a real call, but a coarse clock could: never divide by 0.
    resolution = time.get_clock_info("perf_counter").resolution
    report = Report(
        config=cfg, P=P, reference=reference, tolerance=tolerance, loss_value=value,
        rel_error=abs_error / ref_norm if ref_norm > noise else None,
        max_asymmetry=max_asymmetry(full),
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
    op = hessian_operator(X, target, block_params(weights, cfg), loss=cfg.loss, eps=cfg.eps, head=head)
    V = np.random.default_rng(cfg.seed + 1).standard_normal((op.shape[0], HVP_VECTORS)).astype(full.dtype)
    V /= np.linalg.norm(V, axis=0)
    op.matvec(V[:, 0])  # warm-up
    t0 = time.perf_counter()
    HV = np.stack([op.matvec(V[:, j]) for j in range(HVP_VECTORS)], axis=1)
    seconds = (time.perf_counter() - t0) / HVP_VECTORS
    dense = full @ V
    return fro(HV - dense), fro(dense), seconds


def validate(cfg: Config, args: Any) -> None:
    """Refuse every bad option or combination before any computation: raises UsageError with a
    one-line message (main() prints it as ``blockhess check: error: ...``, exit status 2)."""
    validate_block(cfg)
    if cfg.device == "cuda":
        from ._backend import cuda_available

        try:
            import cupy  # noqa: F401
        except ImportError:
            raise UsageError("--device cuda needs CuPy: pip install 'blockhess[cuda]'") from None
        if not cuda_available():
            raise UsageError("--device cuda needs a CUDA build of blockhess and a visible GPU "
                             "(blockhess.cuda_available() is False)")
    reference = resolve_reference(cfg.reference)
    if reference == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise UsageError("--reference torch needs PyTorch (pip install 'torch==2.13.0'); "
                             "or use --reference finite-differences") from None
    check_memory(cfg, reference)
    json_path, plot_path = getattr(args, "json", None), getattr(args, "plot", None)
    check_outputs({"--json": json_path, "--plot": plot_path})
    if plot_path is not None:
        check_plot_format(plot_path, "--plot")


def _main_model(parser: Any, args: Any) -> int:
    """``blockhess check --model``: the block options do not apply (the model has its own shapes)."""
    allowed = {"model", "vectors", "L", "batch", "seed", "json", "quiet"}
    given = [a for a in vars(args) if a not in allowed and getattr(args, a) != parser.get_default(a)]
    if given:
        options = ", ".join("--" + a.replace("_", "-") for a in given)
        parser.error(f"--model checks the model's own shapes and loss: {options} "
                     f"{'does' if len(given) == 1 else 'do'} not apply (--L, --batch, --seed, --vectors and --json do)")
    for name in ("L", "batch", "vectors"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.json is not None:
        check_outputs({"--json": args.json})
    try:
        import torch  # noqa: F401
    except ImportError:
        parser.error("--model needs PyTorch (pip install 'torch==2.13.0')")
    progress = Progress(enabled=not args.quiet and sys.stderr.isatty())
    with errors_in_the_data(parser):
        try:
            module = load_model(args.model, args.seed)
            report = check_model(module, args.model, args.L, args.batch, args.vectors, args.seed, progress)
        except UsageError as err:
            parser.error(str(err))
        finally:
            progress.close()
    print(format_model_report(report), flush=True)
    with writing_outputs(parser):
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(asdict(report), fh, indent=2)
    return 0 if report.ok else 1


def main(argv: list[str]) -> int:
    """``blockhess check [options]``: 0 verified, 1 an error above its tolerance; SystemExit(2) for a
    bad option or an error in the data (one line on stderr), SystemExit(130) when interrupted."""
    return run_command("blockhess check", _main, argv)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(
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
    whole = parser.add_argument_group("a whole model (instead of a block)")
    whole.add_argument("--model", metavar="FILE|NAME",
                       help="check a model's Hessian-vector products against its own autograd and finite "
                       "differences: an nn.Module saved with torch.save (loading it runs its code: trust the "
                       f"file), or a GPT-2 configuration with random weights ({', '.join(GPT2_CONFIGS)}); "
                       "--L, --batch and --seed apply")
    whole.add_argument("--vectors", type=int, default=3, help="random directions u for H u (default 3)")
    args = parser.parse_args(attach_negative_numbers(list(argv)))
    if args.model is not None:
        return _main_model(parser, args)
    cfg = config_from_args(args, device=args.device, reference=args.reference)
    try:
        validate(cfg, args)
    except UsageError as err:
        parser.error(str(err))

    progress = Progress(enabled=not args.quiet and sys.stderr.isatty())
    torch_hint = " or --reference finite-differences" if resolve_reference(cfg.reference) == "torch" else ""
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
