"""How much blockhess and PyTorch slow down when other processes keep every core busy.

    python benchmarks/busy_machine.py                  # about a minute on 2 cores
    python benchmarks/busy_machine.py --json out.json  # also save the numbers

In one run: the MNIST block loss Hessian (L=49, d=16, d_k=16, d_ff=64, MSE, float64) by
``blockhess.loss_hessian`` and by ``torch.func.hessian`` (the suite's implementations,
``benchmarks/benchmarks/_workloads.py``), plus blockhess's LayerNorm Jacobian at (64, 128), timed first on
the quiet machine, then with one busy-loop process (pure Python ``while True``) per core running
beside them. Each time is the median of several calls after a warm-up call. The slowdown factor is
t(busy) / t(quiet); the target is blockhess's slowdown no worse than torch's. PyTorch runs with one
thread per core, blockhess with its default thread count.

The busy processes are started before and terminated after the busy phase; each also stops by itself
after --busy-timeout seconds or when this script is gone, so none can outlive it. "Quiet" means no
load of ours: the script prints the CPU share other processes took meanwhile (trust runs where it is
near 0; other builds or tests on the machine make the quiet numbers noisy).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the suite, importable as the package `benchmarks`

from benchmarks import _harness, _settings, _torch_methods, _workloads  # noqa: E402
from benchmarks._cpu_load import machine_busy_seconds, own_cpu_seconds  # noqa: E402

SHAPE = (49, 16, 16, 64)  # (L, d, d_k, d_ff): the paper's MNIST block
LN_SHAPE = (64, 128)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class CpuShare:
    """CPU share of everything but this process (busy-loop children included) over a phase."""

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc):
        busy1, elapsed = machine_busy_seconds(), time.perf_counter() - self.t0
        if busy1 is None or self.busy0 is None:
            self.others = None
        else:
            others = (busy1 - self.busy0) - (own_cpu_seconds() - self.own0)
            self.others = max(0.0, others) / (elapsed * cores())
        return False


def _busy_loop(deadline: float, parent: int) -> None:
    """One core's worth of pure-Python busy work, until terminated, the deadline, or the parent is gone."""
    n = 0
    while True:
        n += 1
        if n % 1_000_000 == 0 and (time.time() > deadline or os.getppid() != parent):
            return


def start_busy(count: int, timeout: float) -> list:
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    procs = [ctx.Process(target=_busy_loop, args=(time.time() + timeout, os.getpid()), daemon=True)
             for _ in range(count)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let them reach full speed
    return procs


def stop_busy(procs: list) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():  # pragma: no cover
            p.kill()
            p.join()


def time_calls(fn, repeats: int) -> list[float]:
    """Seconds of `repeats` calls after one warm-up call (garbage collection paused)."""
    fn()
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        if was:
            gc.enable()


def fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="timed blockhess calls per phase (default 15)")
    ap.add_argument("--torch-repeats", type=int, default=5, help="timed torch.func.hessian calls per phase (default 5)")
    ap.add_argument("--busy", type=int, default=None, help="busy-loop processes (default: one per core)")
    ap.add_argument("--busy-timeout", type=float, default=300.0, help="busy loops stop by themselves after this (s)")
    ap.add_argument("--no-layernorm", action="store_true", help="skip the LayerNorm Jacobian rows")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)

    n_cores = cores()
    _settings.THREADS = n_cores  # torch.set_num_threads(n_cores), set on its first import (below)
    torch = _torch_methods.torch()
    import blockhess
    import numpy as np

    get_threads = getattr(blockhess, "get_num_threads", None) or getattr(
        getattr(blockhess, "_core", None), "get_num_threads", None)
    bh_threads = get_threads() if get_threads else f"OpenMP default (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"

    bench = _workloads.BLOCK_HESSIAN
    methods = {
        "blockhess.loss_hessian": (bench.build("blockhess", SHAPE), args.repeats),
        "torch.func.hessian": (bench.build("hessian", SHAPE), args.torch_repeats),
    }
    if not args.no_layernorm:
        ln = _workloads.LN_JACOBIAN
        methods["blockhess.layernorm_jacobian blocks (64,128)"] = (ln.build("blockhess_blocks", LN_SHAPE), 4 * args.repeats)
        methods["blockhess.layernorm_jacobian dense (64,128)"] = (ln.build("blockhess_dense", LN_SHAPE), args.repeats)

    ours = methods["blockhess.loss_hessian"][0]()
    ref = _harness.to_numpy(methods["torch.func.hessian"][0]())
    err = _harness.rel_error(ours, ref)
    if not err < 1e-10:
        print(f"blockhess and torch disagree: relative error {err:.2e}", file=sys.stderr)
        return 1

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    n_busy = n_cores if args.busy is None else args.busy
    print(f"blockhess {blockhess.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, {n_cores} cores (affinity)")
    print(f"threads: blockhess {bh_threads}, torch {torch.get_num_threads()}; busy phase: {n_busy} busy-loop "
          f"processes; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    if load:
        print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    results: dict = {name: {} for name in methods}
    shares = {}
    for phase in ("quiet", "busy"):
        procs = start_busy(n_busy, args.busy_timeout) if phase == "busy" else []
        try:
            with CpuShare() as share:
                for name, (fn, repeats) in methods.items():
                    samples = time_calls(fn, repeats)
                    results[name][phase] = statistics.median(samples)
                    results[name][phase + "_samples"] = samples
        finally:
            stop_busy(procs)
        shares[phase] = share.others
        what = "other processes" if phase == "quiet" else "other processes (the busy loops included)"
        if share.others is not None:
            print(f"{phase} phase: {what} used {100 * share.others:.0f}% of the CPUs")
        if phase == "quiet" and share.others is not None and share.others > 0.1:
            print("warning: the machine was not quiet; quiet times are noisy", file=sys.stderr)

    print()
    print("| method | quiet | busy | slowdown (busy / quiet) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        r["slowdown"] = r["busy"] / r["quiet"]
        print(f"| {name} | {fmt(r['quiet'])} | {fmt(r['busy'])} | {r['slowdown']:.2f}x |")
    bh, th = results["blockhess.loss_hessian"], results["torch.func.hessian"]
    quiet_ratio, busy_ratio = th["quiet"] / bh["quiet"], th["busy"] / bh["busy"]
    met = bh["slowdown"] <= th["slowdown"]
    print()
    print(f"t(torch.func.hessian) / t(blockhess): quiet {quiet_ratio:.1f}x, busy {busy_ratio:.1f}x")
    print(f"target (blockhess slowdown <= torch slowdown): {bh['slowdown']:.2f}x vs {th['slowdown']:.2f}x -> "
          f"{'met' if met else 'MISSED'}")

    if args.json:
        payload = {
            "shape": SHAPE, "ln_shape": LN_SHAPE, "cores": n_cores, "busy_processes": n_busy,
            "blockhess_threads": bh_threads, "torch_threads": torch.get_num_threads(),
            "blockhess_version": blockhess.__version__, "torch_version": torch.__version__,
            "numpy_version": np.__version__, "load_before": load, "other_cpu_share": shares,
            "results": results, "quiet_ratio_torch_over_blockhess": quiet_ratio,
            "busy_ratio_torch_over_blockhess": busy_ratio, "target_met": met, "relative_error": err,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
