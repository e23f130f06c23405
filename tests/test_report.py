"""blockhess report: one quick run writes the report, the page and the numbers; bad options and a
missing torch are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from blockhess import report

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("report")
    done = subprocess.run([sys.executable, "-m", "blockhess", "report", str(outdir), "--quick"],
                          capture_output=True, text=True, timeout=600)
    return outdir, done


def test_quick_report_writes_everything(quick_report):
    outdir, done = quick_report
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and done.stderr == ""  # no progress bar off a terminal
    for name in ("report.md", "report.html", "results.json"):
        assert (outdir / name).stat().st_size > 0
    results = json.loads((outdir / "results.json").read_text())
    for figure in results["figures"].values():
        assert (outdir / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (outdir / "report.md").read_text()
    for figure in results["figures"].values():
        assert f"({figure})" in markdown
    page = (outdir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(results["figures"]) and "src=\"" not in page.replace(
        "src=\"data:", "")


def test_results_hold_every_bound(quick_report):
    outdir, _ = quick_report
    results = json.loads((outdir / "results.json").read_text())
    quantities = [b["quantity"] for b in results["bounds"]]
    for needed in ("Lemma 4: ||J_LN||", "Lemma 4: ||H_LN||", "Thm 1: ||H(K,K)||", "Thm 1: M >= ||H||",
                   "Prop 10: ||S||", "Thm 6: ||H(1,2)||", "Thm 6: M_tr >= ||H||"):
        assert needed in quantities
    assert sum(q.startswith("Thm 6: ||H(") for q in quantities) == 15
    assert any("Thm 7" in q for q in quantities)
    for b in results["bounds"]:
        assert {"quantity", "exact", "stated", "corrected"} <= set(b)
        assert b["corrected_holds"], b
    assert any(b["stated_holds"] is False for b in results["bounds"])  # the counterexamples
    assert all(s["corrected_holds"] for s in results["bounds_summary"])
    assert isinstance(results["exp5"]["slope"], float) and results["exp5"]["slope"] < 0
    scale = results["scaling"]["scale"]
    assert set(scale) == {"attention layer (Thm 1)", "paper block (Thm 6)"}
    assert "W_Q,W_Q" in scale["attention layer (Thm 1)"]["exponents"]
    assert "paper block (Thm 6)" in results["non_convexity"]


def test_report_without_experiments_and_bad_outdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "blockhess", "report", str(blocker)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "not a folder" in done.stderr


def test_missing_torch_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setattr(report, "reference_bounds", lambda quick, seed=0: [])
    monkeypatch.setattr(report, "counterexample_bounds", lambda: [])
    monkeypatch.setattr(report, "random_configuration_summary", lambda n, progress: [])
    monkeypatch.setattr(report, "scaling", _tiny_scaling)
    monkeypatch.setattr(report.report_figures, "tightness", lambda summary, path: "t.png")
    with pytest.raises(SystemExit) as exit_info:  # refused before anything is computed
        report.main([str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("blockhess report: error:") and "blockhess[paper]" in err and "--no-experiments" in err
    assert len(err.strip().splitlines()) == 1


def _tiny_scaling(quick, progress, seed=0):
    import numpy as np

    import blockhess as bh
    from blockhess import analysis

    params = bh.BlockParams.random(d=3, d_k=1, d_ff=2)
    X = np.random.default_rng(0).standard_normal((2, 3))
    sweep = analysis.scale_sweep(X, X, params, scales=[1.0, 2.0])
    return {"scale": {"paper block (Thm 6)": sweep}, "L": {"paper block (Thm 6)": sweep}}


def test_report_outdir_is_created(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "reference_bounds", lambda quick, seed=0: [])
    monkeypatch.setattr(report, "counterexample_bounds", lambda: [])
    monkeypatch.setattr(report, "random_configuration_summary", lambda n, progress: [])
    monkeypatch.setattr(report, "scaling", _tiny_scaling)
    monkeypatch.setattr(report.report_figures, "tightness", lambda summary, path: _blank_png(path))
    out = tmp_path / "a" / "b"
    assert report.main([str(out), "--no-experiments", "--quiet"]) == 0
    assert os.path.isfile(out / "report.html")


def _blank_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path)
    plt.close(fig)
    return os.path.basename(path)
