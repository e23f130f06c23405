"""Library-wide settings: the memory budget that guards dense outputs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_DEFAULT_BUDGET = 4 * 2**30  # 4 GiB


def _budget_from_env() -> int:
    raw = os.environ.get("BLOCKHESS_MEMORY_BUDGET")
    if raw is None:
        return _DEFAULT_BUDGET
    try:
        value = int(float(raw))
    except ValueError:
        raise ValueError(f"BLOCKHESS_MEMORY_BUDGET must be a number of bytes, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"BLOCKHESS_MEMORY_BUDGET must be positive, got {raw!r}")
    return value


_memory_budget = _budget_from_env()


def get_memory_budget() -> int:
    """The largest single output, in bytes, that blockhess will allocate (default 4 GiB)."""
    return _memory_budget


def set_memory_budget(nbytes: int) -> None:
    """Set the largest single output, in bytes, that blockhess will allocate.

    The initial value comes from the environment variable ``BLOCKHESS_MEMORY_BUDGET`` or is 4 GiB.
    """
    global _memory_budget
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes <= 0:
        raise ValueError(f"memory budget must be a positive number of bytes, got {nbytes!r}")
    _memory_budget = int(nbytes)


@contextlib.contextmanager
def memory_budget(nbytes: int) -> Iterator[None]:
    """Context manager that sets the memory budget temporarily."""
    previous = get_memory_budget()
    set_memory_budget(nbytes)
    try:
        yield
    finally:
        set_memory_budget(previous)
