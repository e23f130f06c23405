"""``blockhess report OUTDIR``: the paper's analysis, run end to end (its bounds and experiments).

1. every bound of blockhess.bounds at a reference configuration (exact, as stated, corrected), the
   known counterexamples, and the tightness over random configurations;
2. the scaling sweeps of blockhess.analysis (the scale of X and the sequence length, for the lone
   attention layer of Thm 1 and the paper's block);
3. the experiments of blockhess.experiments on scikit-learn's digits (Exp1, Exp2, Exp3, Exp5).

Writes OUTDIR/report.md, a self-contained OUTDIR/report.html (the figures inlined), the figures as
PNGs and OUTDIR/results.json with every number. ``--quick`` runs smaller sweeps and fewer training
steps (what the tests run).
"""

from __future__ import annotations

import base64
import html
import json
import os
import platform
import re
import sys
import time
from typing import Any, Callable

import numpy as np

from . import _command_files, analysis, bounds, report_figures
from ._command_line import MAX_SEED, ArgumentParser, UsageError, check_seed, run_command, writing_outputs
from .block import BlockParams
from .bounds import counterexamples
from .bounds.configurations import random_configuration
from .spec import BlockSpec

ATTENTION_LAYER = BlockSpec(attention_only=True)

# What the report writes into OUTDIR besides the experiments' figures.
FILES = {"results": "results.json", "markdown": "report.md", "html": "report.html",
         "tightness": "bounds_tightness.png", "scaling_X": "scaling_X.png", "scaling_L": "scaling_L.png"}


def attention_layer(params: BlockParams) -> BlockParams:
    """The lone attention layer (Thm 1) with the block's W_Q, W_K, W_V."""
    return BlockParams.from_arrays(ATTENTION_LAYER, {n: params[n] for n in ("W_Q", "W_K", "W_V")})


# ---- the computations -----------------------------------------------------------------------------


def reference_problem(quick: bool, seed: int = 0):
    """The reference configuration: the paper's block at the digits ViT's sizes (L=16, d=16, d_k=16,
    d_ff=64; smaller with quick), a batch of N(0, 1) tokens and mse targets, weights N(0, 1/fan_in)."""
    L, d, d_k, d_ff, B = (8, 8, 4, 16, 4) if quick else (16, 16, 16, 64, 8)
    rng = np.random.default_rng(seed)
    params = BlockParams.random(d=d, d_k=d_k, d_ff=d_ff, seed=seed)
    return rng.standard_normal((B, L, d)), rng.standard_normal((B, L, d)), params


def reference_bounds(quick: bool, seed: int = 0) -> list[bounds.Bound]:
    from .attention import attention

    X, target, params = reference_problem(quick, seed)
    W = [params[n] for n in ("W_Q", "W_K", "W_V")]
    found = bounds.lemma4(X[0] + attention(X[0], *W))  # the first LayerNorm's input
    found += bounds.theorem1(X, target, attention_layer(params))
    found += bounds.proposition10(X, params)
    found += bounds.theorem6(X, target, params)
    found.append(_theorem7(X, target, params, seed))
    return found


def _theorem7(X, target, params, seed) -> bounds.Bound:
    """Thm 7's quadratic model along a random displacement of 10% of ||w||, M the largest exact ||H_i||."""
    from .block import loss_value
    from .hvp import loss_hvp

    rng = np.random.default_rng(seed + 1)
    w = params.flatten()
    d = rng.standard_normal(w.size)
    d *= 0.1 * np.linalg.norm(w) / np.linalg.norm(d)
    losses = [loss_value(x, t, params) for x, t in zip(X, target)]
    curvatures = [0.5 * float(d @ loss_hvp(x, t, params, d)) for x, t in zip(X, target)]
    M = max(bounds._norms.hessian_norm(x, t, params) for x, t in zip(X, target))
    return bounds.theorem7(losses, curvatures, M=M, distance=float(np.linalg.norm(d)))


def counterexample_bounds() -> list[bounds.Bound]:
    X, W_Q, W_K, W_V = counterexamples.e11_attention()
    layer = BlockParams.from_arrays(ATTENTION_LAYER, {"W_Q": W_Q, "W_K": W_K, "W_V": W_V})
    e11 = [b for b in bounds.theorem1(X, np.zeros_like(X), layer) if "H_o(Q,Q)" in b.quantity]
    e14 = bounds.lemma4(counterexamples.e14_layernorm())
    return [_renamed(e11[0], " [E11 counterexample]")] + [_renamed(b, " [E14 counterexample]") for b in e14]


def _renamed(b: bounds.Bound, suffix: str) -> bounds.Bound:
    return bounds.Bound(b.quantity + suffix, b.exact, b.stated, b.corrected, b.erratum, b.source, b.extra)


def random_configuration_summary(n: int, progress: Callable[[], None]) -> list[dict]:
    """Per quantity over n random configurations: how tight the corrected bound is and how often the
    stated one fails."""
    rows: dict[str, list[bounds.Bound]] = {}
    for i in range(n):
        c = random_configuration(i)
        found = bounds.lemma4(c["X"] * c["scale"], eps=c["eps"])
        found += bounds.theorem1(c["X"], c["target"], attention_layer(c["params"]))
        found += bounds.proposition10(c["X"], c["params"], eps=c["eps"])
        found += bounds.theorem6(c["X"], c["target"], c["params"], eps=c["eps"])
        for b in found:
            rows.setdefault(b.quantity, []).append(b)
        progress()
    summary = []
    for quantity, found in rows.items():
        tight = [b.tightness for b in found]
        stated = [b.exact / b.stated for b in found if b.stated]
        summary.append({
            "quantity": quantity, "configurations": len(found),
            "corrected_holds": all(b.corrected_holds for b in found),
            "tightness_min": float(min(tight)), "tightness_median": float(np.median(tight)),
            "tightness_max": float(max(tight)),
            "stated_failures": sum(b.stated_holds is False for b in found),
            "stated_ratio_max": float(max(stated)) if stated else None,
        })
    return summary


def scaling(quick: bool, progress: Callable[[], None], seed: int = 0) -> dict[str, dict[str, analysis.Sweep]]:
    """Both sweeps, for the lone attention layer and for the paper's block."""
    L, d, d_k, d_ff = (6, 4, 2, 8) if quick else (8, 8, 4, 16)
    scales = np.logspace(-1, 1, 5 if quick else 9)
    lengths = (4, 8, 16) if quick else (4, 8, 16, 32, 64)
    rng = np.random.default_rng(seed)
    X, target = rng.standard_normal((L, d)), rng.standard_normal((L, d))
    block = BlockParams.random(d=d, d_k=d_k, d_ff=d_ff, seed=seed)
    models = {"attention layer (Thm 1)": attention_layer(block), "paper block (Thm 6)": block}
    out: dict[str, dict[str, analysis.Sweep]] = {"scale": {}, "L": {}}
    for name, params in models.items():
        out["scale"][name] = analysis.scale_sweep(X, target, params, scales=scales, progress=progress)
        out["L"][name] = analysis.length_sweep(params, lengths=lengths, seed=seed, progress=progress)
    return out


def require_experiment_packages() -> None:
    """ImportError, saying what to install, unless PyTorch and scikit-learn can be imported."""
    for module, does in (("torch", "train a small ViT with PyTorch"), ("sklearn", "use scikit-learn's digits")):
        try:
            __import__(module)
        except ImportError as err:
            raise ImportError(f'the experiments {does}, which is not installed: pip install "blockhess[paper]" '
                              '(or run blockhess report --no-experiments)') from err


def experiments(outdir: str, quick: bool, seed: int, progress: Callable[[str], None]) -> dict:
    require_experiment_packages()
    from .experiments.paper import run_experiments

    return run_experiments(outdir, quick=quick, progress=progress, seed=seed)


def build(outdir: str, *, quick: bool = False, run_experiments: bool = True, seed: int = 0,
          progress: Callable[[str], None] | None = None) -> dict:
    """Run everything and write the report into ``outdir``; returns the results (as results.json)."""
    os.makedirs(outdir, exist_ok=True)
    note = progress or (lambda _: None)
    n_random = 10 if quick else 50
    started = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "seed": seed, "platform": platform.platform()}
    note("bounds at the reference configuration")
    results["bounds"] = [b.to_dict() for b in reference_bounds(quick, seed) + counterexample_bounds()]
    note(f"bounds over {n_random} random configurations")
    results["bounds_summary"] = random_configuration_summary(n_random, lambda: None)
    note("scaling sweeps")
    sweeps = scaling(quick, lambda: None, seed)
    results["scaling"] = {var: {m: s.to_dict() for m, s in by.items()} for var, by in sweeps.items()}
    results["non_convexity"] = {m: {"most_negative_block": s.most_negative()[0],
                                    "most_negative_eigenvalue": s.most_negative()[1],
                                    "full_min": min(s.min_eigenvalue["full"]),
                                    "functional_min": min(s.min_eigenvalue["functional"])}
                                for m, s in sweeps["scale"].items()}
    figures = {
        "tightness": report_figures.tightness(results["bounds_summary"], os.path.join(outdir, FILES["tightness"])),
        "scaling_X": report_figures.sweep(sweeps["scale"], "c", os.path.join(outdir, FILES["scaling_X"]),
                                          "Exact block norms as X is scaled (X -> c X)"),
        "scaling_L": report_figures.sweep(sweeps["L"], "L", os.path.join(outdir, FILES["scaling_L"]),
                                          "Exact block norms against the sequence length"),
    }
    if run_experiments:
        note("experiments on the digits")
        found = experiments(outdir, quick, seed, note)
        figures.update(found.pop("figures", {}))
        results.update(found)
    results["figures"] = figures
    results["seconds"] = time.perf_counter() - started
    with open(os.path.join(outdir, FILES["results"]), "w") as f:
        json.dump(_jsonable(results), f, indent=1)
    markdown = render_markdown(results)
    with open(os.path.join(outdir, FILES["markdown"]), "w") as f:
        f.write(markdown)
    with open(os.path.join(outdir, FILES["html"]), "w") as f:
        f.write(render_html(markdown, outdir))
    return results


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, tuple) else ",".join(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


# ---- the writing ----------------------------------------------------------------------------------


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def _q(quantity: str) -> str:
    """A quantity for a table cell: norms as ‖.‖ (a | would end the cell)."""
    return quantity.replace("||", "‖")


def render_markdown(r: dict) -> str:
    lines = ["# blockhess report: the paper's bounds, scaling claims and experiments", "",
             f"{'Quick run' if r['quick'] else 'Full run'}, seed {r['seed']}, {r['seconds']:.0f} s on {r['platform']}.",
             "Errata cited are in docs/errata.md. Ratios above 1 mean the bound fails.", "",
             "## 1. Bounds at the reference configuration and on the known counterexamples", "",
             "| quantity | exact | as stated | corrected | exact / stated | exact / corrected | erratum |",
             "|---|---|---|---|---|---|---|"]
    for b in r["bounds"]:
        ratio = b["exact"] / b["stated"] if b["stated"] else None
        lines.append(f"| {_q(b['quantity'])} | {_g(b['exact'])} | {_g(b['stated'])} | {_g(b['corrected'])} | "
                     f"{_g(ratio)}{' **fails**' if b['stated_holds'] is False else ''} | {_g(b['tightness'])} | "
                     f"{b['erratum'] or ''} |")
    n = r["bounds_summary"][0]["configurations"] if r["bounds_summary"] else 0
    lines += ["", f"## 2. Over {n} random configurations", "",
              "Shapes L 2-7, d 3-5, d_k 1-3, d_ff 2-7; weight scales 0.1-10; eps 0 and 0.05; every fifth with "
              "peaked attention.", "",
              "| quantity | corrected holds | exact / corrected: min, median, max | stated fails | largest exact / stated |",
              "|---|---|---|---|---|"]
    for s in r["bounds_summary"]:
        lines.append(f"| {_q(s['quantity'])} | {'yes' if s['corrected_holds'] else '**no**'} | "
                     f"{_g(s['tightness_min'])}, {_g(s['tightness_median'])}, {_g(s['tightness_max'])} | "
                     f"{s['stated_failures']} / {s['configurations']} | {_g(s['stated_ratio_max'])} |")
    lines += ["", f"![tightness]({r['figures']['tightness']})", "", "## 3. Scaling, measured", "",
              "Fitted log-log exponents of the exact block norms (over the whole sweep; in brackets over its "
              "lower half, where attention is near uniform), next to the paper's.", ""]
    for variable, label in (("scale", "‖X‖ (X -> c X, c from 0.1 to 10)"), ("L", "the sequence length L")):
        lines += [f"In {label}:", "", "| model | block | exponent (lower half) | paper |", "|---|---|---|---|"]
        for model, s in r["scaling"][variable].items():
            for key, e in s["exponents"].items():
                lines.append(f"| {model} | ({key.replace('W_', '')}) | {_g(e)} ({_g(s['leading_exponents'][key])}) | "
                             f"{_g(s['claimed'].get(key))} |")
        lines += ["", f"![scaling]({r['figures']['scaling_X' if variable == 'scale' else 'scaling_L']})", ""]
    lines += ["Non-convexity (the smallest eigenvalues along the scale sweep):", "",
              "| model | smallest of H | smallest of the functional part | most negative diagonal block |",
              "|---|---|---|---|"]
    for model, nc in r["non_convexity"].items():
        lines.append(f"| {model} | {_g(nc['full_min'])} | {_g(nc['functional_min'])} | "
                     f"{nc['most_negative_block']} ({_g(nc['most_negative_eigenvalue'])}) |")
    if "exp5" in r:
        lines += _experiment_lines(r)
    return "\n".join(lines) + "\n"


def _experiment_lines(r: dict) -> list[str]:
    t = r.get("training", {})
    lines = ["", "## 4. The experiments on scikit-learn's digits", "",
             f"A ViT (2x2 patches: 16 tokens, d=16, d_ff=64, one post-LN block with LayerNorm parameters and "
             f"biases, mean pooling, a linear head) trained {t.get('steps', '?')} steps in "
             f"{_g(t.get('seconds'))} s: held-out accuracy {_g(t.get('test_accuracy'))}.", "",
             f"Exp5: |L_(k+1) - L_k| against k has log-log slope **{_g(r['exp5'].get('slope'))}** (Thm 7: -1).", ""]
    for name, file in r["figures"].items():
        if name not in ("tightness", "scaling_X", "scaling_L"):
            lines += [f"![{name}]({file})", ""]
    return lines


def render_html(markdown: str, outdir: str) -> str:
    """A self-contained page: the markdown's tables and headings as HTML, the figures inlined."""
    body, table = [], []

    def flush_table():
        if table:
            rows = [row.strip("|").split("|") for row in table if not re.fullmatch(r"\|[-|]+\|", row)]
            cells = lambda row, tag: "".join(f"<{tag}>{_inline(c.strip())}</{tag}>" for c in row)  # noqa: E731
            body.append("<table><tr>" + cells(rows[0], "th") + "</tr>"
                        + "".join("<tr>" + cells(r, "td") + "</tr>" for r in rows[1:]) + "</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        image = re.fullmatch(r"!\[(.*)\]\((.*)\)", line)
        if image:
            with open(os.path.join(outdir, image.group(2)), "rb") as f:
                data = base64.b64encode(f.read()).decode()
            body.append(f'<p><img alt="{html.escape(image.group(1))}" src="data:image/png;base64,{data}"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    flush_table()
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;}table{border-collapse:collapse;"
             "font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>blockhess report</title><style>{style}"
            f"</style></head><body>{''.join(body)}</body></html>\n")


def _inline(text: str) -> str:
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))


# ---- the command line -----------------------------------------------------------------------------


def validate(args: Any) -> None:
    """Refuse every bad option before anything is computed (UsageError, one line): the seed,
    an OUTDIR that cannot be created or written, the packages the report needs."""
    check_seed(args.seed)
    try:
        _command_files.check_output_folder(args.outdir, "OUTDIR", tuple(FILES.values()))
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        report_figures.require_matplotlib()
        if args.experiments:
            require_experiment_packages()
    except ImportError as err:
        raise UsageError(str(err)) from None


def main(argv: list[str]) -> int:
    """``blockhess report OUTDIR [options]``: 0 done, 1 a corrected bound failed; SystemExit(2) for a
    bad option (one line on stderr, nothing computed), SystemExit(130) when interrupted."""
    return run_command("blockhess report", _main, argv)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="blockhess report",
        description="Run the paper's analysis (bounds as stated and corrected against exact norms, scaling "
        "sweeps, the experiments on scikit-learn's digits) and write OUTDIR/report.md, report.html, "
        "results.json and the figures.")
    parser.add_argument("outdir", metavar="OUTDIR", help="the folder to write the report into (created if missing)")
    parser.add_argument("--quick", action="store_true", help="smaller sweeps, fewer training steps (under 2 minutes)")
    parser.add_argument("--no-experiments", dest="experiments", action="store_false",
                        help="skip the experiments (they need PyTorch and scikit-learn)")
    parser.add_argument("--seed", type=int, default=0, help=f"0 to {MAX_SEED} (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        validate(args)
    except UsageError as err:
        parser.error(str(err))
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=None, file=sys.stderr, leave=False, bar_format="{desc} [{elapsed}]")

    def progress(message: str) -> None:
        if bar is not None:
            bar.set_description_str(message)
            bar.update()

    try:
        with writing_outputs(parser):  # a write that fails although OUTDIR was checked (a full disk)
            results = build(args.outdir, quick=args.quick, run_experiments=args.experiments, seed=args.seed,
                            progress=progress)
    finally:
        if bar is not None:
            bar.close()
    failed = [b["quantity"] for b in results["bounds"] if not b["corrected_holds"]]
    failed += [s["quantity"] for s in results["bounds_summary"] if not s["corrected_holds"]]
    print(f"blockhess report: wrote {os.path.join(args.outdir, 'report.md')} (and report.html, results.json) "
          f"in {results['seconds']:.0f} s")
    if failed:
        print(f"blockhess report: a corrected bound failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
