"""The CPU kernel emulator (tests/kernel_emulation.py) itself: it runs a correct kernel right and
flags each defect of tests/cuda_emulator/selftest.cu, so the emulated GPU tests can fail."""

import ctypes

import background_builds
import kernel_emulation
import numpy as np
import pytest

pytestmark = kernel_emulation.needs_emulator

LAUNCH_FAILURE, INVALID_CONFIGURATION = 719, 9


@pytest.fixture(scope="module")
def lib():
    background_builds.result("kernel emulator", kernel_emulation.build_all)
    lib = ctypes.CDLL(str(kernel_emulation.build_selftest()))
    lib.error_string.restype = ctypes.c_char_p
    return lib


def ptr(a: np.ndarray):
    return ctypes.c_void_p(a.__array_interface__["data"][0])


def error(lib, code: int) -> str:
    return lib.error_string(code).decode()


SCHEDULES = ["lockstep", "reverse", "warp-ahead"]


@pytest.fixture(params=SCHEDULES)
def schedule(request, monkeypatch):
    monkeypatch.setenv("BLOCKHESS_EMULATOR_SCHEDULE", request.param)
    return request.param


def run_in(monkeypatch, schedules, launch):
    """{schedule: what launch() returns with the emulator in that schedule}"""
    results = {}
    for name in schedules:
        monkeypatch.setenv("BLOCKHESS_EMULATOR_SCHEDULE", name)
        results[name] = launch()
    return results


@pytest.mark.parametrize("threads", [32, 64, 256])
def test_a_correct_reduction_is_exact_in_every_schedule(lib, schedule, threads):
    x = np.arange(1.0, 1001.0)
    out = np.zeros(2)
    assert lib.block_sum(ptr(x), len(x), threads, ptr(out)) == 0
    assert out.tolist() == [500500.0, 500500.0]


def test_a_missing_barrier_changes_the_result_in_reverse_order(lib, monkeypatch):
    def launch():
        out = np.full(3 * 64, -1.0)
        assert lib.missing_barrier(3, 64, ptr(out)) == 0
        return out.reshape(3, 64)

    results = run_in(monkeypatch, SCHEDULES, launch)
    np.testing.assert_array_equal(results["lockstep"], np.repeat([[1.0], [2.0], [3.0]], 64, axis=1))
    assert (results["reverse"] != results["lockstep"]).any()
    assert (results["warp-ahead"] != results["lockstep"]).any()


def test_shared_memory_reused_too_early_changes_the_result_warp_ahead(lib, monkeypatch):
    def launch():
        out = np.zeros(128)
        assert lib.reused_scratch(128, ptr(out)) == 0
        return out

    results = run_in(monkeypatch, SCHEDULES, launch)
    assert (results["lockstep"] == 128.0).all() and (results["reverse"] == 128.0).all()  # 4 warps x 32 lanes x 1.0
    assert (results["warp-ahead"] != 128.0).any()


def test_an_unknown_schedule_is_refused(lib, monkeypatch):
    monkeypatch.setenv("BLOCKHESS_EMULATOR_SCHEDULE", "random")
    code = lib.exited_lanes(ptr(np.zeros(32)))
    assert code == INVALID_CONFIGURATION
    assert "is not lockstep, reverse or warp-ahead" in error(lib, code)


def test_a_shuffle_with_exited_lanes_is_a_launch_failure(lib):
    code = lib.exited_lanes(ptr(np.zeros(32)))
    assert code == LAUNCH_FAILURE
    assert "reached by 20 of 32 lanes" in error(lib, code)


def test_a_shuffle_in_a_partial_warp_is_a_launch_failure(lib):
    code = lib.block_sum(ptr(np.ones(10)), 10, 48, ptr(np.zeros(2)))
    assert code == LAUNCH_FAILURE
    assert "warp 1 reached by 16 of 32 lanes" in error(lib, code)


@pytest.mark.parametrize("block", [(1025, 1, 1), (32, 32, 2), (1, 1, 65), (0, 1, 1)])
def test_blocks_a_gpu_rejects_are_invalid_configurations(lib, block):
    code = lib.block_of(*block, ptr(np.zeros(2048)))
    assert code == INVALID_CONFIGURATION
    assert "invalid launch configuration: block of" in error(lib, code)


def test_too_much_shared_memory_is_an_invalid_configuration(lib):
    code = lib.shared_bytes(48 * 1024 + 8, ptr(np.zeros(4)))
    assert code == INVALID_CONFIGURATION
    assert "bytes of dynamic shared memory" in error(lib, code)


def test_dynamic_shared_memory_starts_unwritten_as_nan(lib):
    out = np.zeros(4)
    assert lib.shared_bytes(4 * 8, ptr(out)) == 0
    assert np.isnan(out).all()


def test_translate_rewrites_launches_and_shared_memory():
    src = ("  k<T, false><<<dim3(a, b), threads, smem<T>(n, 1, \"x\"),\n      s>>>(X, n);\n"
           "  __shared__ T tile[4];\n  extern __shared__ __align__(16) unsigned char buf[];\n#if defined(__CUDACC__)\n")
    out = kernel_emulation.translate(src)
    assert "::blockhess_emu::launch(k<T, false>, dim3(a, b), threads, smem<T>(n, 1, \"x\"),\n      s)(X, n);" in out
    assert "static thread_local T tile[4];" in out
    assert "unsigned char* buf = ::blockhess_emu::dynamic_shared();" in out
    assert "#if 1" in out
    with pytest.raises(RuntimeError, match="cannot translate"):
        kernel_emulation.translate("__shared__ float a; extern __shared__ float b[];")
