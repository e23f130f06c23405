"""``blockhess spectrum``: its numbers against the dense Hessian of the same seeded problem, its
JSON and density plot, a module saved with torch.save, and its one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

import blockhess
from blockhess import _check_config, spectrum_cli

SMALL = ["--L", "5", "--d", "4", "--d-k", "3", "--d-ff", "6", "--quiet"]


def _dense(argv):
    """The dense Hessian of the problem the command builds for these options (its own parser)."""
    parser = argparse.ArgumentParser()
    _check_config.add_block_options(parser)
    parser.add_argument("--quiet", action="store_true")
    cfg = _check_config.config_from_args(parser.parse_args([*SMALL, *argv]))
    X, target, weights, head = _check_config.make_problem(cfg)
    params = _check_config.block_params(weights, cfg)
    return blockhess.loss_hessian(X, target, params, loss=cfg.loss, head=head), params


@pytest.mark.parametrize("argv", [[], ["--norm-position", "pre", "--bias", "--affine", "--heads", "2", "--d-k", "2",
                                       "--activation", "gelu", "--causal", "--batch", "2"],
                                  ["--loss", "pooled_cross_entropy", "--batch", "3"]])
def test_spectrum_numbers_match_the_dense_hessian(argv, tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "d.png"
    assert spectrum_cli.main([*SMALL, *argv, "-k", "3", "--json", str(out), "--density", str(png)]) == 0
    r = json.loads(out.read_text())
    H, params = _dense(argv)
    values = np.linalg.eigvalsh(H)
    scale = np.abs(values).max()
    assert r["P"] == params.size and r["trace"] == pytest.approx(np.trace(H), rel=1e-12)
    np.testing.assert_allclose(r["top_eigenvalues"], values[-3:], rtol=0, atol=1e-7 * scale)
    np.testing.assert_allclose(r["bottom_eigenvalues"], values[:3], rtol=0, atol=1e-7 * scale)
    for b, (name, s) in zip(r["blocks"], params.slices().items()):
        block = np.linalg.eigvalsh(H[s, s])
        assert b["block"] == name and b["trace"] == pytest.approx(np.trace(H[s, s]), rel=1e-10, abs=1e-14 * scale)
        assert b["min_eigenvalue"] == pytest.approx(block[0], abs=1e-7 * scale)
        assert b["max_eigenvalue"] == pytest.approx(block[-1], abs=1e-7 * scale)
        assert b["frobenius"] == pytest.approx(np.linalg.norm(H[s, s]), rel=1e-12)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.trapezoid(r["density"]["density"], r["density"]["grid"]) == pytest.approx(1.0, abs=1e-3)
    text = capsys.readouterr().out
    assert "top eigenvalues" in text and "W_1" in text and "||H||_F" in text


def test_spectrum_of_a_saved_module(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    layer = torch.nn.TransformerEncoderLayer(4, nhead=2, dim_feedforward=6, dropout=0.0, batch_first=True,
                                             dtype=torch.float64).eval()
    path = tmp_path / "layer.pt"
    torch.save(layer, path)
    assert spectrum_cli.main(["--L", "3", "--module", str(path), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "heads=2" in text and "gamma_2" in text


def test_spectrum_refuses_a_saved_language_model_in_one_line(tmp_path, capsys):
    """Its inputs are token ids, which the command does not make: a one-line error that names what does."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=16,
                                     attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    path = tmp_path / "lm.pt"
    torch.save(transformers.GPT2LMHeadModel(config).eval(), path)
    with pytest.raises(SystemExit) as exit_:
        spectrum_cli.main(["--module", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "a language model" in err and "blockhess check --model" in err


@pytest.mark.parametrize("argv, expected", [
    (["--L", "0"], "--L must be >= 1"),
    (["-k", "0"], "-k must be >= 1"),
    (["--probes", "0"], "--probes must be >= 1"),
    (["--eps", "-1"], "--eps must be a finite number >= 0"),
    (["--d", "4", "--heads", "3"], "the block options do not fit the sizes"),
    (["--module", "/nonexistent.pt"], "no such file"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist"),
])
def test_spectrum_bad_options(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        spectrum_cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockhess spectrum: error: ") and expected in err[0]


def test_spectrum_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "blockhess", "spectrum", *SMALL], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "bottom eigenvalues" in done.stdout


def test_spectrum_frobenius_through_products_and_left_out_above_the_limit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(spectrum_cli, "_DENSE_BLOCK", 1)  # every block through the operator
    monkeypatch.setattr(spectrum_cli, "_FROBENIUS_PRODUCTS", 20)
    out = tmp_path / "s.json"
    assert spectrum_cli.main([*SMALL, "-k", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    H, params = _dense([])
    for b, (name, s) in zip(r["blocks"], params.slices().items()):
        if b["size"] <= 20:
            assert b["frobenius"] == pytest.approx(np.linalg.norm(H[s, s]), rel=1e-12)
        else:
            assert b["frobenius"] is None
    assert any(b["frobenius"] is None for b in r["blocks"]) and any(b["frobenius"] for b in r["blocks"])
    assert "n/a for blocks of more than 20 parameters" in capsys.readouterr().out


def test_spectrum_trace_is_na_where_a_block_diagonal_exceeds_the_budget(tmp_path, capsys, monkeypatch):
    from blockhess import _core, _working_memory

    estimate = _working_memory.model

    def w1_too_large(spec, dims, B, L, itemsize, call, *, selected=None, **options):
        # W_1's factors alone exceed the budget: so do the whole block's; the other blocks fit alone
        names = [name for name, _ in _core.block_parameters(spec._core(), *dims)]
        too_large = call == "diagonal" and (selected is None or selected[names.index("W_1")])
        return 1 << 60 if too_large else estimate(spec, dims, B, L, itemsize, call, selected=selected, **options)

    monkeypatch.setattr(_working_memory, "model", w1_too_large)
    out = tmp_path / "s.json"
    assert spectrum_cli.main([*SMALL, "-k", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    H, params = _dense([])
    traces = {b["block"]: b["trace"] for b in r["blocks"]}
    assert traces["W_1"] is None and r["trace"] is None
    s = params.slices()["W_2"]
    assert traces["W_2"] == pytest.approx(np.trace(H[s, s]), rel=1e-10)
    text = capsys.readouterr().out
    assert "whole block: trace n/a" in text and "BLOCKHESS_MEMORY_BUDGET" in text
