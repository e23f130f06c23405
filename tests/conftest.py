import background_builds
import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(20251019)


def _load_cpu_kernels(**options):
    import kernel_emulation

    pytest.importorskip("pybind11", reason="the CPU kernel emulator is built with pybind11 (pip install '.[test]')")
    background_builds.result("kernel emulator", kernel_emulation.build_all)
    return kernel_emulation.load(**options)


@pytest.fixture(scope="session")
def cpu_kernels():
    """blockhess's CUDA kernels compiled for the CPU (tests/kernel_emulation.py), built once per session."""
    return _load_cpu_kernels()


@pytest.fixture(scope="session")
def cpu_kernels_small_grid():
    """The same with a grid of at most 3 blocks in x, so every grid-stride loop goes round."""
    return _load_cpu_kernels(max_grid_x=3)


@pytest.fixture
def emulated_gpu(monkeypatch, cpu_kernels):
    """The GPU path on NumPy arrays with the kernels compiled for the CPU: blockhess sees a GPU,
    launches go to ``cpu_kernels``. Returns (the cupy stand-in, the launch hooks with ``.calls``)."""
    import cupy_emulation
    import kernel_emulation

    hooks = kernel_emulation.install(monkeypatch, cpu_kernels)
    return cupy_emulation.install(monkeypatch), hooks


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that wait for a slow build run last, and their builds start now, in the background
    (tests/background_builds.py): the compilers use the core the other tests leave idle."""
    waiting = [item for item in items if item.get_closest_marker("background_build")]
    if not waiting or config.option.collectonly:
        return
    items[:] = [item for item in items if not item.get_closest_marker("background_build")] + waiting
    for item in waiting:
        background_builds.start(*item.get_closest_marker("background_build").args)


def pytest_unconfigure(config):
    background_builds.stop()
