"""A NumPy stand-in for CuPy, so the public API's GPU path runs on machines without a GPU.

``DevArray`` is a NumPy array that presents the CUDA Array Interface, so blockhess dispatches it to
the GPU path; ``NumpyCupy`` is the ``cupy`` module as the tests use it (array creation returns
DevArrays, ``cuda.Stream`` is a no-op context). ``install`` makes blockhess believe a GPU is
there; the kernel launches are routed separately, to tests/kernel_emulation.py's real kernels
compiled for the CPU.
"""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace

import numpy as np


class DevArray(np.ndarray):
    """A NumPy array that presents itself as a GPU array (CUDA Array Interface, ``.data.ptr``)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self):
        strides = None if self.flags.c_contiguous else self.strides
        return {"shape": self.shape, "typestr": self.dtype.str, "strides": strides, "version": 3,
                "data": (self.__array_interface__["data"][0], False)}


def to_device(x):
    return x.view(DevArray) if isinstance(x, np.ndarray) and not isinstance(x, DevArray) else x


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def synchronize(self) -> None:
        pass


class _Event:
    def record(self, stream=None) -> None:
        self.seconds = time.perf_counter()

    def synchronize(self) -> None:
        pass


class _Runtime:
    """What the GPU benchmark asks of cupy.cuda.runtime, on host memory."""

    @staticmethod
    def getDeviceProperties(device: int) -> dict:
        return {"name": b"CPU kernel emulator", "major": 0, "minor": 0, "totalGlobalMem": 0}

    @staticmethod
    def deviceGetAttribute(attribute: int, device: int) -> int:
        return 0

    @staticmethod
    def runtimeGetVersion() -> int:
        return 0

    @staticmethod
    def driverGetVersion() -> int:
        return 0

    @staticmethod
    def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    @staticmethod
    def memsetAsync(ptr: int, value: int, nbytes: int, stream: int) -> None:
        ctypes.memset(ptr, value, nbytes)


class _MemoryPool:
    def free_all_blocks(self) -> None:
        pass

    def total_bytes(self) -> int:
        return 0


class _Cuda:
    Stream = _Stream
    Event = _Event
    runtime = _Runtime()

    @staticmethod
    def Device(device: int = 0):  # noqa: N802 - CuPy's name
        return SimpleNamespace(id=device)

    @staticmethod
    def get_current_stream() -> _Stream:
        return _Stream()

    @staticmethod
    def get_elapsed_time(start: _Event, stop: _Event) -> float:
        return (stop.seconds - start.seconds) * 1e3


class NumpyCupy:
    """Stands in for the cupy module: NumPy functions whose array results are DevArrays."""

    ndarray = np.ndarray  # blockhess's GPU path allocates with NumPy here: its outputs are plain arrays
    cuda = _Cuda()
    emulated = True

    def __getattr__(self, name):
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        return lambda *args, **kwargs: to_device(attr(*args, **kwargs))

    @staticmethod
    def asnumpy(a):
        return np.array(a)

    @staticmethod
    def get_default_memory_pool() -> _MemoryPool:
        return _MemoryPool()


def install(monkeypatch) -> NumpyCupy:
    """A GPU for blockhess: DevArrays take the GPU path; returns the cupy stand-in."""
    import blockhess
    from blockhess import _backend

    cupy = NumpyCupy()
    monkeypatch.setattr(_backend, "cuda_available", lambda: True)
    monkeypatch.setattr(blockhess, "cuda_available", lambda: True)
    monkeypatch.setattr(_backend, "device_module", lambda: cupy)
    return cupy


def install_as_module(monkeypatch, cupy: NumpyCupy) -> None:
    """``import cupy`` gives the stand-in. torch loads its compiler (torch._dynamo) lazily and then
    inspects any module named cupy, so it is loaded first, while cupy is what it is."""
    import sys

    try:
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass
    monkeypatch.setitem(sys.modules, "cupy", cupy)
