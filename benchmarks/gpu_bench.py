"""One-shot GPU benchmark for benchmarks/gpu_check.sh: prints a log and writes a markdown table.

    python3 benchmarks/gpu_bench.py --out OUTDIR [--quick] [--ln-shape L,d] [--block-shape L,d,dk,dff ...]
                                     [--torch-device cuda|cpu]

Measures, on the visible GPU (synchronised timings; CUDA events for single kernels):
1. LayerNorm Jacobian blocks at (L, d) = (128, 256): the kernel's achieved bandwidth (bytes
   written + read / time) against a device-to-device copy (read + write bytes / time) and a memset
   on the same GPU, for several tile sizes; the whole public call; torch vmap(jacrev) on the GPU.
2. Full block loss Hessian (MSE, all five matrices) at (16, 32, 32, 64) and (49, 16, 16, 64):
   blockhess on CuPy vs torch.func.hessian on the same GPU, accuracy against both torch and the
   CPU core, GPU memory.
3. Hessian-vector products on the GPU engine (float32): a GPT-2-small-shaped block (L=128, d=768,
   12 heads, d_ff=3072) and a 4-block stack (d=256): one-shot loss_hvp and an operator's product
   against a torch gradient and torch's double-backward HVP of the same loss on the same GPU,
   each measured right after the other; accuracy against the CPU engine.
Writes OUTDIR/results.md and OUTDIR/results.json; exits 0 even when a target is missed (the table
says so), non-zero only if something fails to run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", HERE / "benchmarks" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wall_time(fn, sync, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of synchronised calls."""
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def log(*args):
    print(*args, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--ln-shape", type=_shape(2), default=(128, 256), help="LayerNorm (L, d), default 128,256")
    ap.add_argument("--block-shape", type=_shape(4), action="append", dest="block_shapes",
                    help="block (L, d, d_k, d_ff), repeatable; default 16,32,32,64 and 49,16,16,64")
    ap.add_argument("--torch-device", choices=("cuda", "cpu"), default="cuda", help="where the torch baselines run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    bg = load_bench_gpu()
    bg.TORCH_DEVICE = args.torch_device
    try:
        cupy, blockhess = bg.gpu_modules()
    except NotImplementedError as err:
        msg = f"# blockhess GPU results\n\nNot run: {err}.\n"
        (out / "results.md").write_text(msg)
        log(msg)
        return 2
    import numpy as np

    try:
        torch = bg.torch_cuda()
    except NotImplementedError as err:
        torch = None
        log(f"torch CUDA unavailable: {err}")

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    peak_bw = bg.nominal_bandwidth()
    env = {
        "gpu": name, "compute_capability": f"{props['major']}.{props['minor']}", "memory_GiB": props["totalGlobalMem"] / 2**30,
        "nominal_bandwidth_GBps": peak_bw / 1e9, "python": platform.python_version(), "cupy": cupy.__version__,
        "torch": getattr(torch, "__version__", None), "torch_device": args.torch_device, "blockhess": blockhess.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "driver": cupy.cuda.runtime.driverGetVersion(),
    }
    log("environment:", json.dumps(env))
    results: dict = {"env": env, "ln": {}, "block": {}, "hvp": {}, "errors": []}
    reps = 3 if args.quick else 10
    tsync = bg.torch_sync

    # ---- 1. LayerNorm Jacobian blocks bandwidth ----
    try:
        shape = args.ln_shape
        X = bg.ln_input(shape)
        nbytes_out = shape[0] * shape[1] ** 2 * 8
        copy_bw = bg.copy_bandwidth(nbytes_out + X.nbytes)
        memset_bw = bg.memset_bandwidth(nbytes_out)
        log(f"[ln] D2D copy {copy_bw / 1e9:.0f} GB/s (read+write), memset {memset_bw / 1e9:.0f} GB/s, nominal {peak_bw / 1e9:.0f} GB/s")
        tiles = {}
        for tile in (0, 1024, 2048, 8192, 16384, 65536):
            fn, nbytes = bg.kernel_ln_blocks(shape, tile_elems=tile)
            t = bg.event_time(fn)
            tiles[tile] = {"seconds": t, "GBps": nbytes / t / 1e9}
            log(f"[ln] kernel tile_elems={tile or 'default(4096)'}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s, "
                f"{nbytes / t / copy_bw:.1%} of copy, {nbytes / t / peak_bw:.1%} of nominal")
        fn32, nbytes32 = bg.kernel_ln_blocks(shape, dtype=np.float32)
        t32 = bg.event_time(fn32)
        whole = bg.blockhess_ln_blocks(shape)
        t_whole = wall_time(whole, bg.sync, reps=20)
        err_cpu = bg.rel_error(whole(), blockhess.layernorm_jacobian(X, layout="blocks"))
        ln = {"shape": shape, "copy_GBps": copy_bw / 1e9, "memset_GBps": memset_bw / 1e9, "tiles": tiles,
              "default_GBps": tiles[0]["GBps"], "best_GBps": max(v["GBps"] for v in tiles.values()),
              "float32_GBps": nbytes32 / t32 / 1e9, "public_call_seconds": t_whole, "rel_error_vs_cpu": err_cpu}
        if torch is not None:
            tfn = bg.torch_ln_blocks(shape)
            ln["torch_vmap_jacrev_seconds"] = wall_time(tfn, tsync, reps=reps)
            ln["rel_error_vs_torch"] = bg.rel_error(whole(), tfn())
        results["ln"] = ln
        log("[ln]", json.dumps(ln, default=str))
    except Exception:
        results["errors"].append(traceback.format_exc())
        log(traceback.format_exc())

    # ---- 2. Full block loss Hessian ----
    for shape in args.block_shapes or bg.BLOCK_SHAPES:
        key = "x".join(map(str, shape))
        try:
            ours = bg.blockhess_block_hessian(shape)
            t_ours = wall_time(ours, bg.sync, reps=reps, warmup=2)
            H = ours()
            bg.sync()
            X, target, W = bg.block_inputs(shape)
            t0 = time.perf_counter()
            H_cpu = blockhess.loss_hessian(X, target, blockhess.BlockParams(*W))
            t_cpu = time.perf_counter() - t0
            entry = {"shape": shape, "P": int(H.shape[0]), "blockhess_gpu_seconds": t_ours, "blockhess_cpu_seconds": t_cpu,
                     "rel_error_vs_cpu": bg.rel_error(H, H_cpu), "symmetric": bool((H == H.T).all()),
                     "gpu_peak_over_output": bg.cupy_pool_peak(ours) / H.nbytes}
            if torch is not None:
                theirs = bg.torch_block_hessian(shape)
                t_theirs = wall_time(theirs, tsync, reps=max(2, reps // 3), warmup=1)
                entry.update(torch_hessian_seconds=t_theirs, speedup=t_theirs / t_ours,
                             rel_error_vs_torch=bg.rel_error(H, theirs()),
                             torch_peak_over_output=bg.torch_peak(theirs) / H.nbytes)
            results["block"][key] = entry
            log(f"[block {key}]", json.dumps(entry, default=str))
            del H, H_cpu
        except Exception:
            results["errors"].append(traceback.format_exc())
            log(traceback.format_exc())

    # ---- 3. Hessian-vector products on the GPU engine ----
    for name, *shape in bg.HVP_SHAPES:
        try:
            problem = bg.hvp_problem(*shape)
            one_shot, product, op = bg.blockhess_hvp(problem)
            hv = product()
            bg.sync()
            spec, params, X, target, v = problem
            hv_cpu = blockhess.loss_hvp(X, target, params, v)
            entry = {"P": int(params.size), "engine_on_gpu": op._gpu_op is not None,
                     "loss_hvp_seconds": wall_time(one_shot, bg.sync, reps=reps),
                     "operator_product_seconds": wall_time(product, bg.sync, reps=reps),
                     "rel_error_vs_cpu": bg.rel_error(hv, hv_cpu)}
            if torch is not None:
                gradient, hvp = bg.torch_gradient_and_hvp(problem)
                entry["torch_gradient_seconds"] = wall_time(gradient, tsync, reps=reps)
                entry["torch_hvp_seconds"] = wall_time(hvp, tsync, reps=reps)
                entry["loss_hvp_over_torch_gradient"] = entry["loss_hvp_seconds"] / entry["torch_gradient_seconds"]
                entry["product_over_torch_gradient"] = entry["operator_product_seconds"] / entry["torch_gradient_seconds"]
                entry["torch_hvp_over_loss_hvp"] = entry["torch_hvp_seconds"] / entry["loss_hvp_seconds"]
                entry["rel_error_vs_torch"] = bg.rel_error(hv, hvp().detach().cpu().numpy())
            results["hvp"][name] = entry
            log(f"[hvp {name}]", json.dumps(entry, default=str))
            del op
        except Exception:
            results["errors"].append(traceback.format_exc())
            log(traceback.format_exc())

    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(render(results))
    log((out / "results.md").read_text())
    return 1 if results["errors"] else 0


def _shape(n: int):
    def parse(text: str) -> tuple[int, ...]:
        dims = tuple(int(v) for v in text.split(","))
        if len(dims) != n or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"expected {n} positive integers separated by commas, got {text!r}")
        return dims

    return parse


def render(r) -> str:
    env = r["env"]
    torch_where = "GPU" if env.get("torch_device", "cuda") == "cuda" else "CPU"
    lines = [f"# blockhess GPU results on {env['gpu']} (sm_{env['compute_capability'].replace('.', '')})", "",
             f"CuPy {env['cupy']}, torch {env['torch']}, blockhess {env['blockhess']}, CUDA runtime {env['cuda_runtime']}, "
             f"driver {env['driver']}, Python {env['python']}.", ""]
    ln = r.get("ln") or {}
    if ln:
        frac = ln["default_GBps"] / ln["copy_GBps"]
        best = ln["best_GBps"] / ln["copy_GBps"]
        nominal = env["nominal_bandwidth_GBps"]
        lines += [f"## LayerNorm Jacobian blocks, (L, d) = {tuple(ln['shape'])}, float64", "",
                  "| measure | value |", "|---|---|",
                  f"| device-to-device copy (read + write) | {ln['copy_GBps']:.0f} GB/s |",
                  f"| memset (write) | {ln['memset_GBps']:.0f} GB/s |",
                  f"| nominal HBM bandwidth | {nominal:.0f} GB/s |",
                  f"| blocks kernel, default tile | {ln['default_GBps']:.0f} GB/s = {frac:.0%} of copy, {ln['default_GBps'] / nominal:.0%} of nominal |",
                  f"| blocks kernel, best tile | {ln['best_GBps']:.0f} GB/s = {best:.0%} of copy |",
                  f"| blocks kernel, float32 | {ln['float32_GBps']:.0f} GB/s |",
                  f"| public call (validation, allocation, kernel, zero-variance check) | {ln['public_call_seconds'] * 1e6:.0f} us |"]
        if "torch_vmap_jacrev_seconds" in ln:
            lines.append(f"| torch vmap(jacrev(layer_norm)) on the {torch_where} | {ln['torch_vmap_jacrev_seconds'] * 1e6:.0f} us "
                         f"({ln['torch_vmap_jacrev_seconds'] / ln['public_call_seconds']:.1f}x the public call) |")
        lines += [f"| relative error vs CPU / vs torch | {ln['rel_error_vs_cpu']:.1e} / {ln.get('rel_error_vs_torch', float('nan')):.1e} |",
                  "", f"Target >= 70 % of the memory bandwidth: **{'met' if frac >= 0.7 else 'missed'}** "
                  f"(default tile, against the measured copy bandwidth).", "",
                  "Tile sweep (outputs per thread block): " + ", ".join(
                      f"{k or 'default'}: {v['GBps']:.0f} GB/s" for k, v in ln["tiles"].items()), ""]
    if r.get("block"):
        lines += ["## Full block loss Hessian (MSE, all five matrices), float64", "",
                  f"| (L, d, d_k, d_ff) | P | blockhess GPU | torch.func.hessian {torch_where} | speed-up | blockhess CPU | rel. err vs torch | vs CPU | symmetric | GPU peak / output (ours, torch) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in r["block"].values():
            lines.append(
                f"| {tuple(e['shape'])} | {e['P']} | {e['blockhess_gpu_seconds'] * 1e3:.2f} ms | "
                f"{e.get('torch_hessian_seconds', float('nan')) * 1e3:.1f} ms | {e.get('speedup', float('nan')):.0f}x | "
                f"{e['blockhess_cpu_seconds'] * 1e3:.0f} ms | {e.get('rel_error_vs_torch', float('nan')):.1e} | "
                f"{e['rel_error_vs_cpu']:.1e} | {e['symmetric']} | {e['gpu_peak_over_output']:.1f}, "
                f"{e.get('torch_peak_over_output', float('nan')):.1f} |")
        first = r["block"].get("16x32x32x64")
        if first and "speedup" in first:
            lines += ["", f"Target >= 20x faster than torch.func.hessian at (16, 32, 32, 64): "
                          f"**{'met' if first['speedup'] >= 20 else 'missed'}** ({first['speedup']:.0f}x)."]
        lines.append("")
    if r.get("hvp"):
        lines += ["## Hessian-vector products on the GPU engine, float32 (mse)", "",
                  f"| model | P | engine on GPU | loss_hvp | operator product | torch gradient {torch_where} | "
                  "torch double-backward HVP | loss_hvp / gradient | product / gradient | torch HVP / loss_hvp | "
                  "rel. err vs CPU / torch |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        nan = float("nan")
        for name, e in r["hvp"].items():
            lines.append(
                f"| {name} | {e['P']} | {e['engine_on_gpu']} | {e['loss_hvp_seconds'] * 1e3:.2f} ms | "
                f"{e['operator_product_seconds'] * 1e3:.2f} ms | {e.get('torch_gradient_seconds', nan) * 1e3:.2f} ms | "
                f"{e.get('torch_hvp_seconds', nan) * 1e3:.2f} ms | {e.get('loss_hvp_over_torch_gradient', nan):.2f} | "
                f"{e.get('product_over_torch_gradient', nan):.2f} | {e.get('torch_hvp_over_loss_hvp', nan):.2f} | "
                f"{e['rel_error_vs_cpu']:.1e} / {e.get('rel_error_vs_torch', nan):.1e} |")
        block = r["hvp"].get("gpt2 block", {})
        if "loss_hvp_over_torch_gradient" in block:
            met = block["loss_hvp_over_torch_gradient"] <= 2 and block["torch_hvp_over_loss_hvp"] >= 1.3
            lines += ["", f"Targets for the GPT-2-shaped block, loss_hvp <= 2x a torch gradient and >= 1.3x faster "
                          f"than torch's HVP: **{'met' if met else 'missed'}**."]
        lines.append("")
    if r["errors"]:
        lines += ["## Errors", ""] + ["```\n" + e + "```" for e in r["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
