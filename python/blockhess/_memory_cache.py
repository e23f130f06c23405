"""The CPU core's cache of large buffers.

A call's working arrays (values, cotangents, tangents, factors) are freed when it returns. The
system's allocator would hand large freed blocks back to the operating system, and the next call
would then pay a page fault and a zero fill for every fresh 4 KiB page it writes: on a 2-core VM
that was 40% of a Hessian-vector product's time. The core keeps freed blocks of 256 KiB and more
for the calls that follow, up to a limit (256 MiB by default). What it holds never changes a result.
"""

from __future__ import annotations

import operator

from . import _core
from ._config import _parse_budget


def get_memory_cache_limit() -> int:
    """The most bytes of freed buffers the CPU core keeps for its next calls (default 256 MiB)."""
    return int(_core.get_memory_cache_limit())


def set_memory_cache_limit(nbytes: int | float | str) -> None:
    """Set that limit: 0 keeps nothing (every buffer is freed when its call returns), else a whole
    number of bytes as for :func:`set_memory_budget` (``268435456``, ``2.5e8``, ``"256MiB"``).
    What the cache holds beyond the new limit is freed now."""
    try:
        zero = not isinstance(nbytes, bool) and operator.index(nbytes) == 0
    except TypeError:
        zero = False
    _core.set_memory_cache_limit(0 if zero else _parse_budget(nbytes, "the memory cache limit"))


def cached_memory() -> int:
    """Bytes of freed buffers the cache holds now."""
    return int(_core.cached_memory())


def release_memory() -> int:
    """Free every buffer the cache holds (it fills again with the next calls); returns the bytes freed."""
    return int(_core.release_memory())
