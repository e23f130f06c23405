"""The memory that ``blockhess check`` needs, estimated before anything is computed: refused with a
usage error that says what fits when the memory budget, the machine or the GPU has too little."""

from __future__ import annotations

import math
import os

import numpy as np

from ._check_config import Config
from ._command_line import UsageError
from ._config import format_bytes


_TORCH_OVERHEAD = 256 * 2**20  # the torch runtime itself, counted against the machine only (see _memory_needs)


def available_memory() -> int | None:
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
    """Bytes that one loss_hessian call allocates besides its result (the core's estimate)."""
    from . import _working_memory

    return _working_memory.model(cfg.spec, cfg.dims, cfg.batch, cfg.L, itemsize, "loss_hessian", loss=cfg.loss,
                                 head_classes=cfg.classes if cfg.pooled else 0)


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


def parameter_count(cfg: Config) -> int:
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


def check_memory(cfg: Config, reference: str) -> None:
    budget = memory_budget()
    available = available_memory()
    P = parameter_count(cfg)
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
