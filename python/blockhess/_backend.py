"""Which compiled backend runs a call: _core on the CPU, _cuda for GPU (CuPy) arrays."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from . import _core

try:  # the CUDA module exists only when the package was built with nvcc
    from . import _cuda
except ImportError:  # pragma: no cover - depends on the build
    _cuda = None

_REBUILD = "rebuild with CUDA on a machine with nvcc: BLOCKHESS_CUDA=ON pip install --no-build-isolation --no-deps ."


_device_count: int | None = None


def cuda_available() -> bool:
    """True when blockhess was built with CUDA and a GPU is visible (asked once per process)."""
    global _device_count
    if _cuda is None:
        return False
    if _device_count is None:
        try:
            _device_count = int(_cuda.device_count())
        except RuntimeError:
            _device_count = 0
    return _device_count > 0


def is_device_array(x: Any) -> bool:
    return x is not None and hasattr(x, "__cuda_array_interface__")


def require_gpu() -> None:
    """RuntimeError, saying how to rebuild, unless the CUDA module is built and a GPU is visible."""
    if not cuda_available():
        reason = "this build of blockhess has no CUDA module" if _cuda is None else "no usable GPU is visible"
        raise RuntimeError(f"got a GPU array but {reason}; {_REBUILD}")


def device_module() -> Any:
    """CuPy, for GPU arrays; RuntimeError when the GPU path cannot run in this process."""
    require_gpu()
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            "got a GPU array but CuPy is not installed; blockhess returns CuPy arrays for GPU inputs: "
            "pip install cupy-cuda13x (or the blockhess[cuda] extra)"
        ) from None
    return cupy


def array_module(x: Any) -> Any:
    """NumPy for a host array, CuPy for a GPU array (RuntimeError when the GPU path cannot run)."""
    return device_module() if is_device_array(x) else np


def on_device(*arrays: Any) -> bool:
    """True if the arrays live on a GPU, False if on the host; TypeError when they are mixed."""
    flags = {is_device_array(a) for a in arrays if a is not None}
    if len(flags) > 1:
        raise TypeError(
            "inputs mix host (numpy) and device (CuPy) arrays; move them all to one side first"
        )
    device = flags == {True}
    if device:
        require_gpu()
    return device


def kernels_for(*arrays: Any) -> Any:
    """The compiled functions that run a call on these arrays: ``_core`` for host arrays, ``_gpu`` for
    GPU arrays (the same names and signatures, results written into a device ``out``); TypeError
    when host and device arrays are mixed. A public function is written once, for both."""
    if on_device(*arrays):
        from . import _gpu  # imported here, not above: _gpu reads this module as it loads

        return _gpu
    return _core


def empty(shape: Any, dtype: Any, like: Any) -> Any:
    """An uninitialised result on the side of ``like``: NumPy on the host, CuPy on like's device."""
    if not is_device_array(like):
        return np.empty(shape, dtype=dtype)
    with device_of(like):
        return device_module().empty(shape, dtype=dtype)


def engine_on_host(like: Any, compute: Any, *arrays: Any) -> Any:
    """compute(*arrays), the CPU engine's call. For GPU arrays it runs on host copies and an array
    result comes back on like's device (a Python number as it is): what of the engine still runs on
    the host (the operator's diagonal, the curvature) reads host memory (docs/backends.md)."""
    if not on_device(like):
        return compute(*arrays)
    result = compute(*(to_host(a) for a in arrays))
    return to_device_of(like, result) if isinstance(result, np.ndarray) else result


def to_host(a: Any) -> Any:
    """A host (NumPy) copy of a device array; a host array, or None, as it is."""
    return a if a is None or isinstance(a, np.ndarray) else a.get()


def device_of(a: Any) -> Any:
    """The device context of a CuPy array (a no-op for a NumPy array: the tests' emulated GPU)."""
    return contextlib.nullcontext() if isinstance(a, np.ndarray) else a.device


def to_device_of(x: Any, result: np.ndarray) -> Any:
    """``result``, a host array the engine computed from host copies, copied to the device of x."""
    with device_of(x):
        return device_module().asarray(result)
