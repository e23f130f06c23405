"""The GPU benchmark script (benchmarks/gpu_bench.py, what gpu_check.sh runs) and the asv GPU
benchmarks (benchmarks/benchmarks/bench_gpu.py) run end to end at small sizes on the emulated GPU
(kernels compiled for the CPU, CuPy's NumPy stand-in, torch baselines on the CPU), so that a GPU
session spends its minutes measuring, not debugging the scripts."""

import importlib.util
import json
from pathlib import Path

import cupy_emulation
import kernel_emulation
import numpy as np
import pytest

pytestmark = kernel_emulation.needs_emulator

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_for_benchmarks(monkeypatch, emulated_gpu, cpu_kernels):
    from blockhess import _backend

    pytest.importorskip("torch")
    monkeypatch.setattr(_backend, "_cuda", cpu_kernels)  # the benchmark launches one kernel through it directly
    cupy_emulation.install_as_module(monkeypatch, emulated_gpu[0])


def test_gpu_bench_script_runs_and_reports(gpu_for_benchmarks, tmp_path, monkeypatch):
    gpu_bench = load(BENCHMARKS / "gpu_bench.py")
    real_loader = gpu_bench.load_bench_gpu

    def small_pad_loader():
        bench = real_loader()
        bench.EVENT_PAD_BYTES = 1 << 10  # not 4 GiB of host memory
        small = dict(bench.GPT2, heads=2)
        bench.HVP_SHAPES = [("gpt2 block", small, 4, 8, 4, 16, 1), ("4-block stack", small, 4, 8, 4, 16, 2)]
        return bench

    monkeypatch.setattr(gpu_bench, "load_bench_gpu", small_pad_loader)
    code = gpu_bench.main(["--out", str(tmp_path), "--quick", "--ln-shape", "3,40", "--block-shape", "3,4,2,5",
                           "--block-shape", "2,3,3,4", "--torch-device", "cpu"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and results["errors"] == []
    ln = results["ln"]
    assert ln["shape"] == [3, 40] and set(map(int, ln["tiles"])) == {0, 1024, 2048, 8192, 16384, 65536}
    assert ln["rel_error_vs_cpu"] <= 1e-12 and ln["rel_error_vs_torch"] <= 1e-10
    assert set(results["block"]) == {"3x4x2x5", "2x3x3x4"}
    for entry in results["block"].values():
        assert entry["rel_error_vs_cpu"] <= 1e-12 and entry["rel_error_vs_torch"] <= 1e-10
        assert entry["symmetric"] and entry["speedup"] > 0
    assert set(results["hvp"]) == {"gpt2 block", "4-block stack"}
    for entry in results["hvp"].values():  # float32
        assert entry["engine_on_gpu"] and entry["rel_error_vs_cpu"] <= 1e-5 and entry["rel_error_vs_torch"] <= 1e-4
        assert entry["loss_hvp_over_torch_gradient"] > 0 and entry["torch_hvp_over_loss_hvp"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "LayerNorm Jacobian blocks, (L, d) = (3, 40)" in table and "| (3, 4, 2, 5) |" in table
    assert "## Hessian-vector products on the GPU engine" in table and "| gpt2 block | " in table


def test_gpu_bench_rejects_bad_shapes(capsys):
    gpu_bench = load(BENCHMARKS / "gpu_bench.py")
    with pytest.raises(SystemExit):
        gpu_bench.main(["--out", "unused", "--ln-shape", "3,0"])
    assert "expected 2 positive integers" in capsys.readouterr().err


def test_asv_gpu_benchmarks_run(gpu_for_benchmarks, monkeypatch):
    bench = load(BENCHMARKS / "benchmarks" / "bench_gpu.py")
    monkeypatch.setattr(bench, "TORCH_DEVICE", "cpu")
    monkeypatch.setattr(bench, "EVENT_PAD_BYTES", 1 << 10)
    ln_shape, block_shape = (3, 40), (3, 4, 2, 5)
    for method in bench.TimeGPULayerNormJacobianBlocks.params[0]:
        case = bench.TimeGPULayerNormJacobianBlocks()
        case.setup(method, ln_shape)
        case.time_ln_jacobian_blocks(method, ln_shape)
    for method in bench.TimeGPUBlockLossHessian.params[0]:
        case = bench.TimeGPUBlockLossHessian()
        case.setup(method, block_shape)
        case.time_block_loss_hessian(method, block_shape)
    bandwidth = bench.TrackGPULayerNormBandwidth()
    bandwidth.setup(ln_shape)
    assert bandwidth.track_fraction_of_copy_bandwidth(ln_shape) > 0
    assert bandwidth.track_kernel_bandwidth_GBps(ln_shape) > 0
    track = bench.TrackGPUBlockLossHessian()
    track.setup(block_shape)
    assert track.track_blockhess_gpu_peak_over_output(block_shape) == 0  # the stand-in pool holds nothing
    assert np.isnan(track.track_torch_gpu_peak_over_output(block_shape))  # torch on the CPU: no GPU peak
    assert track.track_rel_error_vs_torch_cuda(block_shape) <= 1e-10
    assert track.track_rel_error_vs_cpu(block_shape) <= 1e-12
