"""For the peak-memory tests, which run their calls in a fresh process (python -c SCRIPT TESTS_DIR,
SCRIPT starting with ``sys.path.insert(0, sys.argv[1])``): the process's high-water mark, and what
each call asked the memory budget for (its result and the core's working-memory estimate,
engine/working_memory.hpp), which must cover the peak."""

from __future__ import annotations

import re


def high_water_mark() -> int:
    """VmHWM: this process's own peak (ru_maxrss may carry the parent's)."""
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1)) * 1024


def record_budget_requests() -> list[int]:
    """From now on, the bytes every block, model, operator and component call checks against the
    budget, in order."""
    import importlib

    asked: list[int] = []
    for name in ("block", "hvp", "attention", "ffn"):  # the modules (blockhess.attention is the function)
        module = importlib.import_module(f"blockhess.{name}")
        checked = module.require_output_fits

        def recording(*args, _checked=checked, **kwargs):
            asked.append(_checked(*args, **kwargs))
            return asked[-1]

        module.require_output_fits = recording
    return asked
