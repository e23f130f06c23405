"""Library-wide settings: the memory budget that guards every allocation that grows with the input.

The budget is set with :func:`set_memory_budget` (or :func:`memory_budget` for a block of code) or
read from the environment variable ``BLOCKHESS_MEMORY_BUDGET`` when it is needed, never at import:
a bad value there is a ``ValueError`` at the first call that needs the budget, and ``import
blockhess`` always works.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import re
from collections.abc import Iterator
from typing import Any

_DEFAULT_BUDGET = 4 * 2**30  # 4 GiB
_ENV = "BLOCKHESS_MEMORY_BUDGET"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_WITH_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

_memory_budget: int | None = None  # None: from the environment, else the default


def _parse_budget(value: Any, source: str) -> int:
    """A positive whole number of bytes from an int, an integral float or a string such as "8GiB"."""
    how = (f"{source} must be a positive whole number of bytes (e.g. 4294967296, 4e9 or '4GiB'), "
           f"got {value!r}")
    if isinstance(value, bool):
        raise TypeError(how)
    if isinstance(value, str):
        match = _WITH_UNIT.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(how)
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        try:
            return _positive(operator.index(value), how)  # int, numpy integers
        except TypeError:
            pass
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(how) from None
    if not math.isfinite(number) or number != math.floor(number):
        raise ValueError(how)
    return _positive(int(number), how)


def _positive(nbytes: int, how: str) -> int:
    if nbytes <= 0:
        raise ValueError(how)
    return nbytes


def get_memory_budget() -> int:
    """The most memory, in bytes, that one blockhess call may allocate for its result and its
    working arrays together (default 4 GiB; ``BLOCKHESS_MEMORY_BUDGET`` or
    :func:`set_memory_budget`). ValueError when the environment variable is not a byte count."""
    if _memory_budget is not None:
        return _memory_budget
    raw = os.environ.get(_ENV)
    return _DEFAULT_BUDGET if raw is None else _parse_budget(raw, f"the environment variable {_ENV}")


def set_memory_budget(nbytes: int | float | str) -> None:
    """Set the memory budget: a positive whole number of bytes (an int, a numpy integer, an
    integral float such as ``4e9``, or a string with a unit such as ``"8GiB"``). Inf, NaN and
    fractions are refused."""
    global _memory_budget
    _memory_budget = _parse_budget(nbytes, "the memory budget")


@contextlib.contextmanager
def memory_budget(nbytes: int | float | str) -> Iterator[None]:
    """Context manager that sets the memory budget temporarily."""
    global _memory_budget
    previous = _memory_budget
    set_memory_budget(nbytes)
    try:
        yield
    finally:
        _memory_budget = previous


def format_bytes(nbytes: float) -> str:
    """A size for people: "512 bytes", "3.1 KiB", "40.0 MiB", "4.00 GiB"."""
    if nbytes < 1024:
        return f"{int(nbytes)} bytes"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
