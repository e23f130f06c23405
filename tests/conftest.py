import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(20251019)


@pytest.fixture(scope="session")
def cpu_kernels():
    """blockhess's CUDA kernels compiled for the CPU (tests/kernel_emulation.py), built once per session."""
    import kernel_emulation

    pytest.importorskip("pybind11", reason="the CPU kernel emulator is built with pybind11 (pip install '.[test]')")
    return kernel_emulation.load()


@pytest.fixture(scope="session")
def cpu_kernels_small_grid():
    """The same with a grid of at most 3 blocks in x, so every grid-stride loop goes round."""
    import kernel_emulation

    pytest.importorskip("pybind11", reason="the CPU kernel emulator is built with pybind11 (pip install '.[test]')")
    return kernel_emulation.load(max_grid_x=3)
