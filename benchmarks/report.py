"""Quick benchmark report without asv: blockhess vs PyTorch autograd vs the physical floors.

    python benchmarks/report.py                 # quick subset (< 2 minutes on 2 cores)
    python benchmarks/report.py --full          # every size of the asv suite (several minutes)
    python benchmarks/report.py --out DIR       # where report.md and speedups.png go

Uses the same inputs and method implementations as the asv suite (``benchmarks/benchmarks/common.py``).
Each method is called once to warm up (its output is kept to check blockhess against autograd), then
timed timeit-style: each sample runs the call enough times to last >= 20 ms, and the median of up to
5 samples (fewer for slow calls, within a per-method time budget) is reported. Very slow calls
(> 4 s) are timed by their single first call. A blockhess API missing at this commit is reported as n/a.

The ratio column is t(method) / t(blockhess of the same output layout): how many times faster blockhess
is. For a floor, a ratio below 1 means blockhess takes longer than the floor.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))

import common  # noqa: E402
import numpy as np  # noqa: E402

# (bench, params) of the quick subset: every target of issue 4 plus one size of each benchmark.
QUICK = [
    ("ln_jacobian", ((16, 64),)),
    ("ln_jacobian", ((64, 128),)),
    ("ln_hessian", ((8, 32),)),
    ("ln_hessian", ((16, 64),)),
    ("ffn_jacobian", ("W_1", (16, 64, 256))),
    ("ffn_jacobian", ("W_2", (16, 64, 256))),
    ("attention_jacobian", ("W_Q", (16, 32, 32))),
    ("attention_jacobian", ("W_K", (16, 32, 32))),
    ("attention_jacobian", ("W_V", (16, 32, 32))),
    ("block_hessian", ((8, 16, 16, 32),)),
    ("block_hessian", ((49, 16, 16, 64),)),
    ("block_hessian", ((16, 32, 32, 64),)),
]
# Slow baselines left out of the quick run (they only make the report longer, not more informative).
QUICK_SKIP = {
    ("attention_jacobian", "autograd_jacobian"): lambda p: p[0] != "W_Q",
}

SAMPLE_MIN_S = 0.02  # each sample lasts at least this long (timeit's autorange idea)
MAX_SAMPLES = 5
BUDGET_S = 1.5  # per method, after warm-up
SLOW_S = 4.0  # a first call longer than this is the measurement


@dataclass
class Row:
    bench: str
    params: tuple
    method: str
    seconds: float | None = None
    samples: int = 0
    note: str = ""
    ratio: float | None = None
    error: float | None = None
    extra: dict = field(default_factory=dict)


def full_subset():
    out = []
    for bench in common.BENCHES.values():
        combos = [()]
        for values in bench.params:
            combos = [c + (v,) for c in combos for v in values]
        out += [(bench.name, c) for c in combos]
    return out


def measure(fn):
    """(median seconds, number of samples, first output)."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    if first > SLOW_S:
        return first, 1, out
    number = max(1, math.ceil(SAMPLE_MIN_S / max(first, 1e-7)))
    samples, spent = [], 0.0
    gc_was = gc.isenabled()
    gc.disable()
    try:
        while len(samples) < MAX_SAMPLES and spent < BUDGET_S:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            dt = time.perf_counter() - t0
            spent += dt
            samples.append(dt / number)
    finally:
        if gc_was:
            gc.enable()
    return statistics.median(samples), len(samples), out


def run(subset, log, quick: bool) -> list[Row]:
    rows: list[Row] = []
    for bench_name, params in subset:
        bench = common.BENCHES[bench_name]
        ours_out: dict[str, object] = {}
        group: list[Row] = []
        # blockhess first, so that its outputs can be checked against the autograd references
        order = sorted(bench.methods, key=lambda m: {"ours": 0, "torch": 1, "floor": 2}[m.kind])
        for m in order:
            row = Row(bench_name, params, m.name)
            group.append(row)
            skip = QUICK_SKIP.get((bench_name, m.name))
            if skip is not None and quick and skip(params):
                row.note = "n/a (skipped in the quick run)"
                continue
            try:
                fn = bench.build(m.name, *params)
                row.seconds, row.samples, out = measure(fn)
            except NotImplementedError as err:
                row.note = f"n/a ({err})"
                log(f"  {bench_name} {params} {m.name}: {row.note}")
                continue
            except Exception as err:  # report, never crash
                row.note = f"n/a ({type(err).__name__}: {err})"
                log(f"  {bench_name} {params} {m.name}: {row.note}")
                continue
            if m.kind == "ours":
                ours_out[m.layout] = out
            elif m.kind == "torch" and bench.reference(m.layout) == m.name and m.layout in ours_out:
                ours_row = next(r for r in group if r.method == bench.ours(m.layout))
                ours_row.error = common.rel_error(ours_out.pop(m.layout), out)
            del out
            log(f"  {bench_name} {params} {m.name}: {fmt_time(row.seconds)} ({row.samples} samples)")
        ours_out.clear()
        for row in group:
            ours = bench.ours(bench.method(row.method).layout)
            ref = next((r for r in group if r.method == ours), None)
            if row.seconds is not None and ref is not None and ref.seconds is not None:
                row.ratio = row.seconds / ref.seconds
        rows += [r for m in bench.methods for r in group if r.method == m.name]  # suite order
    return rows


def fmt_time(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "n/a"
    if r >= 100:
        return f"{r:,.0f}x"
    if r >= 10:
        return f"{r:.1f}x"
    return f"{r:.2f}x"


def fmt_params(params) -> str:
    return " ".join(str(p).replace(" ", "") for p in params)


def get(rows, bench, params, method) -> Row | None:
    return next((r for r in rows if r.bench == bench and r.params == params and r.method == method), None)


def targets(rows, peaks) -> list[tuple[str, str, str, str]]:
    """(target, measured, required, verdict) for each target of issue 4 found in `rows`."""
    out = []

    def ratio(bench, params, slow, fast):
        a, b = get(rows, bench, params, slow), get(rows, bench, params, fast)
        if a is None or b is None or a.seconds is None or b.seconds is None:
            return None
        return a.seconds / b.seconds

    def add(name, value, need, ok, unit="x"):
        if value is None:
            out.append((name, "n/a", need, "not measured"))
        else:
            out.append((name, f"{value:,.1f}{unit}" if value >= 10 else f"{value:.2f}{unit}", need,
                        "met" if ok(value) else "MISSED"))

    p = ((64, 128),)
    add("LN Jacobian blocks (64,128) vs jacrev (dense)", ratio("ln_jacobian", p, "jacrev_dense", "blockhess_blocks"),
        ">= 500x", lambda v: v >= 500)
    add("LN Jacobian blocks (64,128) vs vmap(jacrev)", ratio("ln_jacobian", p, "vmap_jacrev_blocks", "blockhess_blocks"),
        ">= 4x", lambda v: v >= 4)
    add("LN Jacobian dense (64,128): time / allocate+zero floor",
        ratio("ln_jacobian", p, "blockhess_dense", "floor_dense"), "<= 1.5x", lambda v: v <= 1.5)
    p = ("W_1", (16, 64, 256))
    add("FFN Jacobian W_1 (16,64,256) vs autograd.functional.jacobian",
        ratio("ffn_jacobian", p, "autograd_jacobian", "blockhess"), ">= 1000x", lambda v: v >= 1000)
    add("FFN Jacobian W_1 (16,64,256) vs jacrev", ratio("ffn_jacobian", p, "jacrev", "blockhess"),
        ">= 20x", lambda v: v >= 20)
    p = ((49, 16, 16, 64),)
    add("Block Hessian (49,16,16,64) vs torch.func.hessian", ratio("block_hessian", p, "hessian", "blockhess"),
        ">= 20x", lambda v: v >= 20)
    add("Block Hessian (49,16,16,64) vs numpy J^T J GEMM floor", ratio("block_hessian", p, "floor_gemm", "blockhess"),
        "> 1x", lambda v: v > 1)
    p = ((16, 32, 32, 64),)
    add("Block Hessian (16,32,32,64) vs torch.func.hessian", ratio("block_hessian", p, "hessian", "blockhess"),
        ">= 10x", lambda v: v >= 10)
    for shape, m in peaks.items():
        if m is None:
            add(f"Block Hessian {fmt_params((shape,))} peak memory", None, "", None)
            continue
        L, d = shape[:2]
        slack = 8 * L * d * max(common.BLOCK_HESSIAN.sizes(shape))  # bytes of one (L d, max n_i) array
        excess = (m["peak"] - m["base"] - 2 * m["nbytes"]) / slack
        add(f"Block Hessian {fmt_params((shape,))} peak RSS increase "
            f"{(m['peak'] - m['base']) / 2**20:.1f} MiB, output {m['nbytes'] / 2**20:.1f} MiB: "
            f"(increase - 2 x output) / (8 L d max n_i bytes)", excess, "<= 8 (O(L d max n_i))",
            lambda v: v <= 8, unit="")
    return out


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu = f"{fields.get('model name', cpu)} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    versions = [f"Python {platform.python_version()}", f"numpy {np.__version__}"]
    try:
        import blockhess

        versions.append(f"blockhess {blockhess.__version__}")
    except ImportError:
        versions.append("blockhess not installed")
    try:
        versions.append(f"torch {common.torch().__version__} ({common.torch().get_num_threads()} threads)")
    except NotImplementedError:
        versions.append("torch not installed")
    return f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()}; " + ", ".join(versions) + "; float64"


def markdown(rows, target_rows, header: str) -> str:
    lines = [header, "", "| benchmark | size | method | time | t / t(blockhess) | rel. error vs autograd |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        bench = common.BENCHES[r.bench]
        m = bench.method(r.method)
        time_s = fmt_time(r.seconds) if r.seconds is not None else r.note
        err = f"{r.error:.1e}" if r.error is not None else ("" if m.kind != "ours" else "n/a")
        label = m.label if m.kind != "ours" else f"**{m.label}**"
        lines.append(f"| {bench.title} | {fmt_params(r.params)} | {label} | {time_s} | {fmt_ratio(r.ratio)} | {err} |")
    lines += ["", "| target (issue 4) | measured | required | verdict |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in target_rows]
    return "\n".join(lines) + "\n"


def chart(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for r in rows:
        bench = common.BENCHES[r.bench]
        m = bench.method(r.method)
        if m.kind == "ours" or r.ratio is None:
            continue
        ours = bench.method(bench.ours(m.layout)).label
        bars.append((f"{bench.title} {fmt_params(r.params)}: {ours} vs {m.label}", r.ratio, m.kind))
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(bars) + 1.4))
    y = np.arange(len(bars))[::-1]
    colors = ["tab:blue" if kind == "torch" else "tab:gray" for _, _, kind in bars]
    ax.barh(y, [b[1] for b in bars], color=colors)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=7.5)
    for yi, (_, v, _) in zip(y, bars):
        ax.text(v * 1.08, yi, fmt_ratio(v), va="center", fontsize=7)
    ax.set_xlim(min(0.1, min(b[1] for b in bars) / 2), max(b[1] for b in bars) * 6)
    ax.set_xlabel("speed-up of blockhess = t(method) / t(blockhess)  (log scale; blue: PyTorch autograd, "
                  "gray: floors, < 1 means blockhess is slower)")
    ax.set_title("blockhess vs PyTorch autograd (float64, 2 threads)")
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every size of the asv suite (slow)")
    parser.add_argument("--out", default=os.path.join(HERE, "report"), help="output folder")
    parser.add_argument("--only", nargs="*", choices=sorted(common.BENCHES), help="restrict to these benchmarks")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-memory subprocess measurement")
    args = parser.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if os.environ.get("OPENBLAS_CORETYPE") or os.environ.get("OPENBLAS_L2_SIZE"):
        log("note: OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE are set; the numpy GEMM floor may be slower than it could be")
    subset = full_subset() if args.full else QUICK
    if args.only:
        subset = [s for s in subset if s[0] in args.only]
    t0 = time.perf_counter()
    rows = run(subset, log, quick=not args.full)
    peaks = {}
    if not args.no_peak and (not args.only or "block_hessian" in args.only):
        for shape in [(49, 16, 16, 64), (16, 32, 32, 64)]:
            try:
                peaks[shape] = common.peak_memory("block_hessian", "blockhess", shape)
            except (NotImplementedError, Exception) as err:  # noqa: BLE001 - report, never crash
                log(f"  peak memory {shape}: n/a ({err})")
                peaks[shape] = None
    elapsed = time.perf_counter() - t0
    header = (f"Machine: {machine()}.  \n"
              f"`python benchmarks/report.py{' --full' if args.full else ''}`, {elapsed:.0f} s; median of up to "
              f"{MAX_SAMPLES} timeit-style samples after a warm-up call.")
    text = markdown(rows, targets(rows, peaks), header)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    chart(rows, os.path.join(args.out, "speedups.png"))
    log(f"wrote {os.path.join(args.out, 'report.md')} and speedups.png in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
