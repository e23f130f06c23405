"""Quick benchmark report without asv: blockhess vs PyTorch autograd vs the physical floors.

    python benchmarks/report.py                 # quick subset (< 2 minutes on 2 cores) -> build/report/
    python benchmarks/report.py --full          # every size of the asv suite (several minutes)
    python benchmarks/report.py --out DIR       # where report.md and speedups.png go

By default the report goes to build/report/ (ignored by git), so a run never changes tracked files.
The copy the README shows lives in docs/performance/ and is regenerated on purpose with
``python benchmarks/report.py --out docs/performance``.

Uses the same inputs and method implementations as the asv suite (``benchmarks/benchmarks/_workloads.py``).
Each method is called once to warm up (its output is kept to check blockhess against autograd), then
timed timeit-style: each sample runs the call enough times to last >= 20 ms, and the median of up to
5 samples (at least one, fewer for slow calls, within a per-method time budget) is reported: first
calls of torch.func transforms are several times slower than later ones. Calls slower than 12 s (the
autograd.functional loops, which have no warm-up cost) are timed by their single first call. A blockhess API missing at this commit is reported as n/a.

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
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "build", "report")  # untracked (.gitignore: build/)
sys.path.insert(0, HERE)  # the suite, importable as the package `benchmarks`

from benchmarks import _harness, _peak_memory, _torch_methods, _workloads  # noqa: E402
from benchmarks._cpu_load import machine_busy_seconds, own_cpu_seconds  # noqa: E402
import numpy as np  # noqa: E402

# (bench, params) of the quick subset: every performance target plus one size of each benchmark.
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
    ("attention_jacobian", "autograd_jacobian"): lambda p: True,
    ("ffn_jacobian", "autograd_jacobian"): lambda p: p[0] != "W_1",
    ("block_hessian", "autograd_hessian"): lambda p: p[0] != (49, 16, 16, 64),
}

SAMPLE_MIN_S = 0.02  # each sample lasts at least this long (timeit's autorange idea)
MAX_SAMPLES = 5
BUDGET_S = 1.5  # per method, after warm-up
SLOW_S = 12.0  # a first call longer than this is the measurement (autograd.functional loops only)


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
    for bench in _workloads.BENCHES.values():
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
        bench = _workloads.BENCHES[bench_name]
        ours_out: dict[str, object] = {}
        group: list[Row] = []
        # blockhess first, so that its outputs can be checked against the autograd references
        order = sorted(bench.methods, key=lambda m: {"ours": 0, "torch": 1, "floor": 2}[m.kind])
        for m in order:
            row = Row(bench_name, params, m.name)
            group.append(row)
            skip = QUICK_SKIP.get((bench_name, m.name))
            if skip is not None and quick and skip(params):
                row.note = "not run in the quick report (python benchmarks/report.py --full runs it)"
                continue
            try:
                fn = bench.build(m.name, *params)
                row.seconds, row.samples, out = measure(fn)
            except NotImplementedError as err:
                row.note = str(err)
                log(f"  {bench_name} {params} {m.name}: n/a ({row.note})")
                continue
            except Exception as err:  # report, never crash
                row.note = f"{type(err).__name__}: {err}"
                log(f"  {bench_name} {params} {m.name}: n/a ({row.note})")
                continue
            if m.kind == "ours":
                ours_out[m.layout] = out
            elif m.kind == "torch" and bench.reference(m.layout) == m.name:
                # blockhess outputs of this layout, and structured ones that rebuild into it
                for layout in [k for k in ours_out if k == m.layout or bench.reference(k) is None]:
                    ours_row = next(r for r in group if r.method == bench.ours(layout))
                    mine = ours_out.pop(layout)
                    if layout != m.layout:
                        mine = bench.densify(layout, mine, *params)
                    ours_row.error = _harness.rel_error(mine, out)
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
    if r >= 0.1:
        return f"{r:.2f}x"
    return f"{r:.2g}x"


def fmt_params(params) -> str:
    return " ".join(str(p).replace(" ", "") for p in params)


def get(rows, bench, params, method) -> Row | None:
    return next((r for r in rows if r.bench == bench and r.params == params and r.method == method), None)


# The speed targets: (description, bench, params, slower method, faster method, op, required)
# with ratio = t(slower) / t(faster).
TARGETS = [
    ("LN Jacobian blocks (64,128) vs torch.func.jacrev (dense)", "ln_jacobian", ((64, 128),),
     "jacrev_dense", "blockhess_blocks", ">=", 500),
    ("LN Jacobian blocks (64,128) vs vmap(jacrev) over rows", "ln_jacobian", ((64, 128),),
     "vmap_jacrev_blocks", "blockhess_blocks", ">=", 4),
    ("LN Jacobian dense (64,128): t(blockhess) / t(allocate+zero floor)", "ln_jacobian", ((64, 128),),
     "blockhess_dense", "floor_dense", "<=", 1.5),
    ("FFN Jacobian W_1 (16,64,256) vs autograd.functional.jacobian", "ffn_jacobian", ("W_1", (16, 64, 256)),
     "autograd_jacobian", "blockhess", ">=", 1000),
    ("FFN Jacobian W_1 (16,64,256) vs torch.func.jacrev", "ffn_jacobian", ("W_1", (16, 64, 256)),
     "jacrev", "blockhess", ">=", 20),
    ("FFN Jacobian W_1 (16,64,256) Kronecker factors vs autograd.functional.jacobian (dense)", "ffn_jacobian",
     ("W_1", (16, 64, 256)), "autograd_jacobian", "blockhess_kron", ">=", 1000),
    ("FFN Jacobian W_1 (16,64,256) Kronecker factors vs torch.func.jacrev (dense)", "ffn_jacobian",
     ("W_1", (16, 64, 256)), "jacrev", "blockhess_kron", ">=", 20),
    ("Block Hessian (49,16,16,64) vs torch.func.hessian", "block_hessian", ((49, 16, 16, 64),),
     "hessian", "blockhess", ">=", 20),
    ("Block Hessian (49,16,16,64) vs numpy J^T J GEMM floor", "block_hessian", ((49, 16, 16, 64),),
     "floor_gemm", "blockhess", ">", 1),
    ("Block Hessian (16,32,32,64) vs torch.func.hessian", "block_hessian", ((16, 32, 32, 64),),
     "hessian", "blockhess", ">=", 10),
]
_OPS = {">=": lambda v, r: v >= r, ">": lambda v, r: v > r, "<=": lambda v, r: v <= r}


def target_ratio(rows, bench, params, slow, fast) -> float | None:
    a, b = get(rows, bench, params, slow), get(rows, bench, params, fast)
    if a is None or b is None or a.seconds is None or b.seconds is None:
        return None
    return a.seconds / b.seconds


def targets(rows, peaks) -> list[tuple[str, str, str, str]]:
    """(target, measured, required, verdict) for each performance target."""
    out = []
    for desc, bench, params, slow, fast, op, need in TARGETS:
        v = target_ratio(rows, bench, params, slow, fast)
        if v is None:
            out.append((desc, "n/a", f"{op} {need}x", "not measured"))
        else:
            out.append((desc, fmt_ratio(v), f"{op} {need}x", "met" if _OPS[op](v, need) else "**missed**"))
    for shape, m in peaks.items():
        desc = f"Block Hessian {fmt_params((shape,))} peak memory: RSS increase during the call"
        if m is None:
            out.append((desc, "n/a", "<= 2 x output + O(L d max n_i)", "not measured"))
            continue
        L, d = shape[:2]
        slack = 8 * L * d * max(_workloads.BLOCK_HESSIAN.sizes(shape))  # one (L d, max n_i) float64 array
        inc = m["peak"] - m["base"]
        ok = inc <= 2 * m["nbytes"] + 8 * slack
        out.append((desc, f"{inc / 2**20:.1f} MiB = {inc / m['nbytes']:.2f} x output ({m['nbytes'] / 2**20:.1f} MiB)",
                    f"<= 2 x output + 8 x {slack / 2**20:.1f} MiB (L d max n_i doubles)",
                    "met" if ok else "**missed**"))
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
        versions.append(f"torch {_torch_methods.torch().__version__} ({_torch_methods.torch().get_num_threads()} threads)")
    except NotImplementedError:
        versions.append("torch not installed")
    try:
        import subprocess

        git = ["git", "-C", HERE]
        rev = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        if rev:
            versions.append(f"commit {rev}{' + local changes' if dirty else ''}")
    except OSError:
        pass
    try:
        import blockhess

        core = f"blockhess core {blockhess._core.build_info['isa']}, {blockhess.get_num_threads()} threads"
    except (ImportError, AttributeError, KeyError):
        core = "blockhess core of unknown build"
    return (f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()}; " + ", ".join(versions)
            + f"; float64; {core}")


def markdown(rows, target_rows, header: str) -> str:
    lines = [header, "", "| benchmark | size | method | time | t / t(blockhess) | rel. error vs autograd |",
             "|---|---|---|---|---|---|"]
    notes: list[str] = []
    for r in rows:
        bench = _workloads.BENCHES[r.bench]
        m = bench.method(r.method)
        if r.seconds is not None:
            time_s = fmt_time(r.seconds)
        else:
            if r.note not in notes:
                notes.append(r.note)
            time_s = f"n/a [{notes.index(r.note) + 1}]"
        err = f"{r.error:.1e}" if r.error is not None else ("" if m.kind != "ours" else "n/a")
        label = m.label if m.kind != "ours" else f"**{m.label}**"
        lines.append(f"| {bench.title} | {fmt_params(r.params)} | {label} | {time_s} | {fmt_ratio(r.ratio)} | {err} |")
    if notes:
        lines.append("")
        lines += [f"[{i + 1}] n/a: {n}.  " for i, n in enumerate(notes)]
    lines += ["", "| target | measured | required | verdict |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in target_rows]
    return "\n".join(lines) + "\n"


def chart(rows, path: str) -> None:
    """Horizontal bars of blockhess's speed-up over each autograd method (and the GEMM floor), log scale,
    with the performance targets marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(bench, params, ours, other):
        many = sum(m.kind == "ours" for m in bench.methods) > 1
        what = f"{bench.short} {ours.chart_label}" if many else bench.short
        return f"{what} {fmt_params(params)} vs {other.chart_label}"

    need = {(b, p, slow, fast): (op, r) for _, b, p, slow, fast, op, r in TARGETS}
    bars = []  # (label, ratio, kind, target or None)
    groups = list(dict.fromkeys((r.bench, r.params) for r in rows))
    for b, p in groups:
        bench = _workloads.BENCHES[b]
        for r in rows:
            if (r.bench, r.params) != (b, p):
                continue
            m = bench.method(r.method)
            if r.ratio is None or m.kind == "ours" or (m.kind == "floor" and r.method != "floor_gemm"):
                continue
            ours = bench.method(bench.ours(m.layout))
            bars.append((label(bench, p, ours, m), r.ratio, m.kind, need.get((b, p, r.method, ours.name))))
        # cross-layout targets (LN blocks vs dense jacrev) get their own bar
        for _, tb, tp, slow, fast, op, req in TARGETS:
            ms, mf = bench.method(slow) if tb == b else None, bench.method(fast) if tb == b else None
            if tb == b and tp == p and mf.kind == "ours" and ms.layout != mf.layout:
                v = target_ratio(rows, b, p, slow, fast)
                if v is not None:
                    bars.append((f"{label(bench, p, mf, ms)} ({ms.layout})", v, ms.kind, (op, req)))
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(bars) + 1.6))
    y = np.arange(len(bars))[::-1]
    colors = ["tab:blue" if kind == "torch" else "tab:gray" for _, _, kind, _ in bars]
    ax.barh(y, [b[1] for b in bars], color=colors, height=0.7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8)
    hi = max(max(b[1] for b in bars), max((t[1] for *_, t in bars if t), default=1))
    for yi, (_, v, _, tgt) in zip(y, bars):
        ax.text(v * 1.1, yi, fmt_ratio(v), va="center", fontsize=7.5)
        if tgt:
            ax.plot([tgt[1]] * 2, [yi - 0.42, yi + 0.42], color="tab:red", lw=2)
    ax.set_xlim(min(0.5, min(b[1] for b in bars) / 2), hi * 8)
    ax.set_xlabel("speed-up of blockhess, t(other) / t(blockhess), log scale")
    ax.set_title("blockhess vs PyTorch autograd, float64, 2 threads", fontsize=11)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:blue", label="PyTorch autograd"),
                       Patch(color="tab:gray", label="numpy J^T J GEMM floor"),
                       Line2D([], [], color="tab:red", lw=2, label="target")],
              loc="upper right", fontsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every size of the asv suite (slow)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="output folder (default: build/report/ in the repository, untracked; "
                             "docs/performance is the copy the README shows)")
    parser.add_argument("--only", nargs="*", choices=sorted(_workloads.BENCHES), help="restrict to these benchmarks")
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
    busy0, own0 = machine_busy_seconds(), own_cpu_seconds(children=True)
    rows = run(subset, log, quick=not args.full)
    peaks = {}
    if not args.no_peak and (not args.only or "block_hessian" in args.only):
        for shape in [(49, 16, 16, 64), (16, 32, 32, 64)]:
            try:
                peaks[shape] = _peak_memory.peak_memory("block_hessian", "blockhess", shape)
            except (NotImplementedError, Exception) as err:  # noqa: BLE001 - report, never crash
                log(f"  peak memory {shape}: n/a ({err})")
                peaks[shape] = None
    elapsed = time.perf_counter() - t0
    others = ""
    busy1 = machine_busy_seconds()
    if busy0 is not None and busy1 is not None:
        other_seconds = (busy1 - busy0) - (own_cpu_seconds(children=True) - own0)
        share = max(0.0, other_seconds) / (elapsed * (os.cpu_count() or 1))
        others = f" Other processes used {100 * share:.0f}% of the CPUs meanwhile."
        if share > 0.1:
            log(f"warning: other processes used {100 * share:.0f}% of the CPUs during the run; timings are noisy")
    header = (f"Machine: {machine()}.  \n"
              f"`python benchmarks/report.py{' --full' if args.full else ''}`, {elapsed:.0f} s; median of up to "
              f"{MAX_SAMPLES} timeit-style samples after a warm-up call.{others}")
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
