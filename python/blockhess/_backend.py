"""Which compiled backend runs a call: _core on the CPU, _cuda for GPU (CuPy) arrays."""

from __future__ import annotations

from typing import Any

from . import _core

try:  # the CUDA module exists only when the package was built with nvcc
    from . import _cuda
except ImportError:  # pragma: no cover - depends on the build
    _cuda = None


def cuda_available() -> bool:
    """True when blockhess was built with CUDA and a GPU is visible."""
    if _cuda is None:
        return False
    try:
        return _cuda.device_count() > 0
    except RuntimeError:
        return False


def is_device_array(x: Any) -> bool:
    return x is not None and hasattr(x, "__cuda_array_interface__")


def on_device(*arrays: Any) -> bool:
    """True if the arrays live on a GPU, False if on the host; TypeError when they are mixed."""
    flags = {is_device_array(a) for a in arrays if a is not None}
    if len(flags) > 1:
        raise TypeError(
            "inputs mix host (numpy) and device (CuPy) arrays; move them all to one side first"
        )
    device = flags == {True}
    if device and not cuda_available():
        reason = "this build of blockhess has no CUDA module" if _cuda is None else "no usable GPU is visible"
        raise RuntimeError(
            f"got a GPU array but {reason}; rebuild with CUDA on a machine with nvcc: "
            "BLOCKHESS_CUDA=ON pip install --no-build-isolation --no-deps ."
        )
    return device
