"""The main job, ``blockhess check``: it runs, verifies, reports, and fails when it should."""

import json
import subprocess
import sys

import numpy as np
import pytest

from blockhess import check

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


def test_check_with_finite_differences_batch_and_cross_entropy(capsys):
    code = check.main([*SMALL, "--batch", "2", "--loss", "cross_entropy", "--eps", "1e-3",
                       "--reference", "finite-differences"])
    assert code == 0
    text = capsys.readouterr().out
    assert "finite-differences" in text and "W_1-W_2" in text and "OK" in text


def test_check_float32(capsys):
    assert check.main([*SMALL, "--dtype", "float32"]) == 0


def test_check_fails_when_the_reference_disagrees(monkeypatch, capsys):
    real = check._torch_reference

    def perturbed(*args):
        H, t = real(*args)
        H = H.copy()
        H[0, 0] *= 1 + 1e-6
        return H, t

    monkeypatch.setattr(check, "_torch_reference", perturbed)
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


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_check_on_the_emulated_gpu(monkeypatch, tmp_path, emulated_gpu, loss):
    """--device cuda end to end, the kernels emulated on the CPU (tests/kernel_emulation.py)."""
    import cupy_emulation

    cupy, kernels = emulated_gpu
    cupy_emulation.install_as_module(monkeypatch, cupy)
    out = tmp_path / "report.json"
    assert check.main([*SMALL, "--device", "cuda", "--batch", "2", "--loss", loss, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["config"]["device"] == "cuda"
    assert report["rel_error"] <= 1e-10 and report["max_asymmetry"] == 0.0
    assert {"kron_accumulate", "mirror_upper", "layernorm_forward"} <= set(kernels.calls)


def test_problem_is_seeded():
    cfg = check.Config(L=3, d=4, d_k=2, d_ff=5)
    a, b = check.make_problem(cfg), check.make_problem(cfg)
    np.testing.assert_array_equal(a[0], b[0])
