"""The main job, ``blockhess check``: it runs, verifies, reports, and fails when it should."""

import io
import json
import math
import os
import subprocess
import sys
import time
import types

import kernel_emulation
import numpy as np
import pytest

from blockhess import _check_config, _check_memory, _check_references, check

SMALL = ["--L", "5", "--d", "4", "--d-k", "3", "--d-ff", "6", "--quiet"]


def test_check_passes_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    assert check.main([*SMALL, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["reference"] == "torch"
    assert report["P"] == 2 * 4 * 3 + 16 + 2 * 4 * 6
    assert len(report["blocks"]) == 15
    assert report["rel_error"] <= 1e-10 and report["max_asymmetry"] == 0.0
    for b in report["blocks"]:
        assert b["rel_error"] <= 1e-10


def test_check_verifies_the_matrix_free_product(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert check.main([*SMALL, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["hvp_ok"] and report["hvp_rel_error"] <= 1e-12 and report["time_hvp_s"] > 0
    assert "matrix-free H v (hessian_operator, 4 vectors): relative error" in capsys.readouterr().out


BLOCK_OPTIONS = {
    "pooled": ["--loss", "pooled_cross_entropy", "--classes", "3", "--batch", "2"],
    "pre-everything": ["--norm-position", "pre", "--affine", "--bias", "--heads", "2", "--d-k", "2", "--out-proj",
                       "--activation", "gelu_tanh", "--causal", "--eps", "1e-5"],
    "rmsnorm-pooled": ["--norm", "rmsnorm", "--affine", "--activation", "silu", "--eps", "1e-6",
                       "--loss", "pooled_cross_entropy"],
    "post-heads-gelu-ce": ["--heads", "2", "--d-k", "2", "--bias", "--activation", "gelu", "--loss", "cross_entropy"],
}


@pytest.mark.parametrize("name", sorted(BLOCK_OPTIONS))
def test_check_block_options_and_the_pooled_loss(name, tmp_path, capsys):
    """The spec flags and --loss pooled_cross_entropy: the family's block against torch.func.hessian of
    the family's torch reference, every parameter pair, and the matrix-free product."""
    out = tmp_path / "report.json"
    assert check.main([*SMALL, *BLOCK_OPTIONS[name], "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cfg = _check_config.Config(**{k: v for k, v in report["config"].items()})
    names = [n for n, _ in cfg.parameters()]
    assert report["ok"] and report["reference"] == "torch"
    assert len(report["blocks"]) == len(names) * (len(names) + 1) // 2
    assert report["rel_error"] <= 1e-10 and report["hvp_rel_error"] <= 1e-12 and report["max_asymmetry"] == 0.0
    text = capsys.readouterr().out
    assert ", ".join(names) in text and cfg.describe() in text


def test_check_block_options_fail_when_the_reference_disagrees(monkeypatch, capsys):
    real = _check_references.torch_reference

    def perturbed(*args):
        H, t = real(*args)
        H = H.copy()
        H[-1, -1] *= 1 + 1e-6
        return H, t

    monkeypatch.setattr(_check_references, "torch_reference", perturbed)
    assert check.main([*SMALL, *BLOCK_OPTIONS["pooled"]]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_check_block_options_with_finite_differences(capsys):
    argv = [*SMALL, *BLOCK_OPTIONS["rmsnorm-pooled"], "--reference", "finite-differences"]
    assert check.main(argv) == 0
    assert "finite-differences" in capsys.readouterr().out


def test_the_paper_block_is_described_as_before(capsys):
    assert _check_config.Config().describe() == "post-LN Transformer block"
    assert _check_config.Config(norm_position="pre", heads=4, causal=True).describe() == \
        "pre-LN Transformer block (4 heads, causal)"


def test_a_wrong_matrix_free_product_fails(monkeypatch, capsys):
    real = check.hessian_operator

    class Off:  # the real operator, off by 1e-6 relative
        def __init__(self, *args, **kwargs):
            self.op = real(*args, **kwargs)
            self.shape = self.op.shape

        def matvec(self, v):
            return self.op.matvec(v) * (1 + 1e-6)

    monkeypatch.setattr(check, "hessian_operator", Off)
    assert check.main(SMALL) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "matrix-free H v" in text.split("above tolerance")[0].splitlines()[-1]


def test_check_with_finite_differences_batch_and_cross_entropy(capsys):
    code = check.main([*SMALL, "--batch", "2", "--loss", "cross_entropy", "--eps", "1e-3",
                       "--reference", "finite-differences"])
    assert code == 0
    text = capsys.readouterr().out
    assert "finite-differences" in text and "W_1-W_2" in text and "OK" in text


def test_check_float32(capsys):
    assert check.main([*SMALL, "--dtype", "float32"]) == 0


def test_check_fails_when_the_reference_disagrees(monkeypatch, capsys):
    real = _check_references.torch_reference

    def perturbed(*args):
        H, t = real(*args)
        H = H.copy()
        H[0, 0] *= 1 + 1e-6
        return H, t

    monkeypatch.setattr(_check_references, "torch_reference", perturbed)
    assert check.main(SMALL) == 1
    assert "FAILED" in capsys.readouterr().out


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "h.png"
    assert check.main([*SMALL, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_entry_point_and_module():
    done = subprocess.run([sys.executable, "-m", "blockhess", "check", *SMALL], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "speed-up" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "blockhess", "check", "--L", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--L must be >= 1" in bad.stderr


def test_cuda_device_without_a_gpu_is_a_clear_error():
    import blockhess

    if blockhess.cuda_available():
        pytest.skip("a GPU is visible")
    done = subprocess.run([sys.executable, "-m", "blockhess", "check", "--device", "cuda", *SMALL],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--device cuda needs" in done.stderr


@kernel_emulation.needs_emulator
@pytest.mark.parametrize("loss,block", [("mse", []), ("cross_entropy", []),
                                        ("pooled_cross_entropy", ["--norm-position", "pre", "--norm", "rmsnorm",
                                                                  "--affine", "--heads", "2", "--activation", "gelu"])])
def test_check_on_the_emulated_gpu(monkeypatch, tmp_path, emulated_gpu, loss, block):
    """--device cuda end to end for the paper's block and one of the family with the pooled head, the
    kernels emulated on the CPU (tests/kernel_emulation.py)."""
    import cupy_emulation

    cupy, kernels = emulated_gpu
    cupy_emulation.install_as_module(monkeypatch, cupy)
    out = tmp_path / "report.json"
    argv = [*SMALL, "--device", "cuda", "--batch", "2", "--loss", loss, *block, "--json", str(out)]
    assert check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["config"]["device"] == "cuda"
    assert report["rel_error"] <= 1e-10 and report["max_asymmetry"] == 0.0 and report["hvp_ok"]
    assert "loss_hessian" in kernels.calls  # the engine, with its GPU assembly target


def test_problem_is_seeded():
    cfg = _check_config.Config(L=3, d=4, d_k=2, d_ff=5)
    a, b = _check_config.make_problem(cfg), _check_config.make_problem(cfg)
    np.testing.assert_array_equal(a[0], b[0])


# --- degenerate sizes: a Hessian that is exactly zero, or rounding noise -----------------------------


@pytest.mark.parametrize("argv", [
    ["--d", "1", "--eps", "1e-3"],  # LayerNorm of one feature: Z == 0 whatever the weights
    ["--d", "2"],  # LayerNorm of two features: +-1 whatever the weights, H is rounding noise
    ["--d", "2", "--dtype", "float32"],
    ["--d", "2", "--loss", "cross_entropy", "--batch", "2"],
    ["--d", "2", "--reference", "finite-differences"],
    ["--d", "1", "--eps", "1e-3", "--reference", "finite-differences", "--dtype", "float32"],
])
def test_degenerate_sizes_pass(argv, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = check.main(["--L", "6", "--d-k", "3", "--d-ff", "5", "--quiet", *argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert text.rstrip().endswith("OK") and "n/a" in text and "above tolerance" not in text
    report = json.loads(out.read_text())  # valid JSON: no NaN or Infinity
    assert report["ok"] and report["rel_error"] is None and report["error_floor"] > 0
    assert report["abs_error"] <= report["tolerance"] * report["error_floor"]
    assert all(b["ok"] for b in report["blocks"])


def test_degenerate_d2_at_the_default_sizes(capsys):
    assert check.main(["--d", "2", "--quiet"]) == 0
    assert "zero reference" in capsys.readouterr().out


def _corrupt_loss_hessian(monkeypatch, relative=0.0, absolute=0.0):
    """check.loss_hessian with H[0, 0] moved (symmetric, and outer + functional == full still holds)."""
    real = check.loss_hessian

    def corrupted(*args, part="full", **kwargs):
        H = real(*args, part=part, **kwargs).copy()
        if part in ("full", "outer"):
            H[0, 0] += relative * np.linalg.norm(H) + absolute
        return H

    monkeypatch.setattr(check, "loss_hessian", corrupted)


@pytest.mark.parametrize("argv, relative, absolute", [
    (["--d", "2"], 0.0, 1e-8),  # zero Hessian: an entry of 1e-8 is no rounding noise
    (["--d", "1", "--eps", "1e-3"], 0.0, 1e-8),
    (["--d", "2", "--dtype", "float32"], 0.0, 1e-2),
    ([], 1e-3, 0.0),  # a normal problem, off by 1e-3 relative
    (["--dtype", "float32"], 1e-3, 0.0),
])
def test_a_corrupted_result_still_fails(monkeypatch, capsys, argv, relative, absolute):
    _corrupt_loss_hessian(monkeypatch, relative, absolute)
    assert check.main([*SMALL, *argv]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "W_Q-W_Q" in text.split("above tolerance")[0].splitlines()[-1]


def test_noise_floor_is_far_below_a_normal_hessian():
    """On a normal problem the floor never replaces the relative tolerance in float64."""
    report, _ = check.run_check(_check_config.Config(L=5, d=4, d_k=3, d_ff=6))
    assert report.ok and report.rel_error is not None
    assert report.error_floor < 1e-2 * report.reference_norm


def test_zero_time_gives_a_finite_speedup(monkeypatch):
    clock = iter(float(i // 2) for i in range(10**6))  # every timed interval is 0
    frozen = types.SimpleNamespace(perf_counter=lambda: next(clock), get_clock_info=time.get_clock_info)
    for module in (check, _check_references):  # the closed form's clock and the reference's
        monkeypatch.setattr(module, "time", frozen)
    report, _ = check.run_check(_check_config.Config(L=3, d=2, d_k=2, d_ff=3))
    assert report.time_closed_form_s == 0.0 and math.isfinite(report.speedup)


# --- bad options: one line, exit status 2, nothing computed -------------------------------------------


@pytest.fixture
def no_computation(monkeypatch):
    """Fail the test if anything is computed."""
    def refuse(*args, **kwargs):
        raise AssertionError("computed although the options were bad")

    monkeypatch.setattr(_check_config, "make_problem", refuse)
    for name in ("loss_hessian", "loss_value"):
        monkeypatch.setattr(check, name, refuse)
    for name in ("torch_reference", "finite_difference_reference"):
        monkeypatch.setattr(_check_references, name, refuse)


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        check.main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockhess check: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--eps", "-1"], "--eps must be a finite number >= 0, got -1.0"),
    (["--eps", "nan"], "--eps must be a finite number >= 0, got nan"),
    (["--eps", "inf"], "--eps must be a finite number >= 0, got inf"),
    (["--eps", "-inf"], "--eps must be a finite number >= 0, got -inf"),
    (["--eps", "-1e-3"], "--eps must be a finite number >= 0, got -0.001"),
    (["--d", "1"], "--d 1 with --eps 0"),
    (["--d", "1", "--eps", "0"], "pass --eps > 0"),
    (["--L", "0"], "--L must be >= 1, got 0"),
    (["--d", "0"], "--d must be >= 1"),
    (["--d-k", "-3"], "--d-k must be >= 1"),
    (["--d-ff", "0"], "--d-ff must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--L", "2.5"], "argument --L: invalid int value: '2.5'"),
    (["--L"], "argument --L: expected one argument"),
    (["--loss", "hinge"], "argument --loss: invalid choice"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--L", "100000", "--d", "512", "--d-ff", "4096"], "more than the memory budget"),
    (["--d", "128", "--d-ff", "512"], "use smaller sizes"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--loss", "pooled_cross_entropy", "--classes", "0"], "--classes must be >= 1"),
    (["--d", "4", "--heads", "3"], "the block options do not fit the sizes"),
    (["--activation", "tanh"], "argument --activation: invalid choice"),
    (["--norm-position", "middle"], "argument --norm-position: invalid choice"),
])
def test_bad_options_are_one_line_errors_before_any_computation(argv, expected, capsys, no_computation):
    line = _usage_error(argv, capsys)
    assert expected in line


def test_huge_sizes_say_what_was_asked_what_fits_and_what_to_do(capsys, no_computation):
    line = _usage_error(["--L", "100000", "--d", "512", "--d-ff", "4096"], capsys)
    assert "P = 4472832 parameters" in line and "memory budget" in line and "smaller sizes" in line


def test_torch_reference_is_not_counted_against_blockhess_budget(capsys):
    import blockhess

    # The budget bounds blockhess's own allocations (the Hessian, 62 KiB, and its working memory);
    # torch's reference is checked against the machine's memory instead.
    with blockhess.memory_budget(256 * 2**10):
        assert check.main([*SMALL, "--reference", "torch"]) == 0
    assert "OK" in capsys.readouterr().out


def test_more_than_the_machine_has(monkeypatch, capsys, no_computation):
    monkeypatch.setattr(_check_memory, "available_memory", lambda: 400 * 2**20)  # the MNIST block: FD fits, torch not
    line = _usage_error(["--reference", "torch"], capsys)
    assert "available on this machine" in line and "--reference finite-differences" in line


def test_unknown_available_memory_checks_the_budget_only(monkeypatch):
    monkeypatch.setattr(_check_memory, "available_memory", lambda: None)
    check.validate(_check_config.Config(L=5, d=4, d_k=3, d_ff=6), None)


def test_bad_memory_budget_variable(monkeypatch, capsys, no_computation):
    import blockhess._config as config

    monkeypatch.setattr(config, "_memory_budget", None, raising=False)
    monkeypatch.setenv("BLOCKHESS_MEMORY_BUDGET", "lots")
    try:
        config.get_memory_budget()
    except ValueError:
        pass
    else:
        pytest.skip("this blockhess reads BLOCKHESS_MEMORY_BUDGET at import only")
    assert "BLOCKHESS_MEMORY_BUDGET" in _usage_error(SMALL, capsys)


def _not_writable_paths(tmp_path, suffix):
    regular = tmp_path / "a-file"
    regular.write_text("")
    paths = [
        ("/nonexistent/dir/x" + suffix, "does not exist"),
        (str(regular / ("x" + suffix)), "is not a directory"),  # the parent is a regular file
        (str(tmp_path), "is a directory"),
    ]
    if os.geteuid() != 0:  # root ignores permissions
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        read_only.chmod(0o500)
        locked = tmp_path / ("locked" + suffix)
        locked.write_text("")
        locked.chmod(0o400)
        paths += [(str(read_only / ("x" + suffix)), "permission denied"), (str(locked), "not writable")]
    return paths


@pytest.mark.parametrize("option, suffix", [("--json", ".json"), ("--plot", ".png")])
def test_unwritable_output_paths(option, suffix, tmp_path, capsys, no_computation):
    if option == "--plot":
        pytest.importorskip("matplotlib")
    paths = _not_writable_paths(tmp_path, suffix)
    before = sorted(tmp_path.rglob("*"))
    for path, expected in paths:
        line = _usage_error([*SMALL, option, path], capsys)
        assert f"{option} {path}" in line and expected in line, line
    assert sorted(tmp_path.rglob("*")) == before  # nothing created


def test_plot_needs_a_format_matplotlib_writes(tmp_path, capsys, no_computation):
    pytest.importorskip("matplotlib")
    line = _usage_error([*SMALL, "--plot", str(tmp_path / "h.xyz")], capsys)
    assert "cannot write .xyz files" in line
    assert not (tmp_path / "h.xyz").exists()


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys, no_computation):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    line = _usage_error([*SMALL, "--plot", str(tmp_path / "h.png")], capsys)
    assert "--plot needs matplotlib" in line


def test_same_file_for_json_and_plot(tmp_path, capsys, no_computation):
    pytest.importorskip("matplotlib")
    line = _usage_error([*SMALL, "--json", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")], capsys)
    assert "same file" in line


def test_torch_reference_without_torch(monkeypatch, capsys, no_computation):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert "--reference torch needs PyTorch" in _usage_error([*SMALL, "--reference", "torch"], capsys)


def test_auto_reference_without_torch_is_finite_differences(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert _check_references.resolve_reference("auto") == "finite-differences"


def test_write_failure_after_the_run_is_one_line(monkeypatch, tmp_path, capsys):
    from blockhess import _command_files

    monkeypatch.setattr(_command_files, "check_output_file", lambda path, option: None)  # as for root under /proc
    with pytest.raises(SystemExit) as exit_info:
        check.main([*SMALL, "--json", str(tmp_path / "missing" / "x.json")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "OK" in captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith("blockhess check: error: cannot write")


def test_an_error_in_the_data_is_one_line(monkeypatch, capsys):
    def degenerate(*args, **kwargs):
        from blockhess import layernorm

        layernorm(np.ones((2, 3)))  # a LayerNorm row of zero variance with eps=0: blockhess's ValueError

    monkeypatch.setattr(check, "loss_hessian", degenerate)
    line = _usage_error(SMALL, capsys)
    assert "variance" in line or "LayerNorm" in line or "layernorm" in line


def test_a_bug_in_the_check_keeps_its_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug in check.py")

    monkeypatch.setattr(_check_config, "make_problem", broken)
    with pytest.raises(ValueError, match="a bug in check.py"):
        check.main(SMALL)


def test_interrupt_exits_130_quietly(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "loss_hessian", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        check.main(SMALL)
    captured = capsys.readouterr()
    assert exit_info.value.code == 130
    assert "Traceback" not in captured.err and captured.err.count("\n") <= 1


def test_bad_option_from_the_command_line_is_one_line():
    done = subprocess.run([sys.executable, "-m", "blockhess", "check", "--eps", "-1"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockhess check: error: --eps"), done.stderr


# --- progress: one bar on a terminal, nothing otherwise -------------------------------------------------


def test_no_progress_output_when_stderr_is_not_a_terminal(capsys):
    assert check.main(["--L", "5", "--d", "4", "--d-k", "3", "--d-ff", "6", "--reference", "finite-differences"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.rstrip().endswith("OK")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_one_progress_bar_on_a_terminal(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert check.main(["--L", "5", "--d", "4", "--d-k", "3", "--d-ff", "6", "--reference", "finite-differences"]) == 0
    shown = terminal.getvalue()
    assert "closed form" in shown and "finite differences" in shown and "per-block" in shown
    assert "/110" in shown  # one bar: 6 closed-form steps + H v + P = 88 columns + 15 blocks
    assert "[blockhess]" not in shown  # no separate lines
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_quiet_terminal_and_no_tqdm(monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert check.main(SMALL) == 0
    assert terminal.getvalue() == ""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: a line per phase instead of the bar
    assert check.main(SMALL[:-1]) == 0
    lines = terminal.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and all(line.startswith("[blockhess] ") for line in lines)


def test_a_reader_that_goes_away_gets_no_traceback():
    """blockhess check | head: the report's write finds a closed pipe; exit 141 quietly."""
    proc = subprocess.Popen([sys.executable, "-m", "blockhess", "check", *SMALL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read()
    proc.wait()
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()
