"""How busy the machine is: CPU seconds of the whole machine (/proc/stat) and of this process, for
the scripts that report how much other processes ran beside a measurement."""

from __future__ import annotations

import os
import resource


def machine_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine so far (/proc/stat), or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(*, children: bool = False) -> float:
    """CPU seconds this process has used (and, with children=True, its finished child processes)."""
    who = [resource.RUSAGE_SELF] + ([resource.RUSAGE_CHILDREN] if children else [])
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))
