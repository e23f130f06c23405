"""Peak memory of one call, measured in a fresh process (no PyTorch, no other benchmark's garbage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ._workloads import BENCHES

_PEAK_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks import _harness, _settings, _workloads
_settings.TORCH_FIRST = False
args = json.loads(sys.argv[2])
params = [tuple(p) if isinstance(p, list) else p for p in args["params"]]
fn = _workloads.BENCHES[args["bench"]].build(args["method"], *params)   # inputs prepared, untimed

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
except OSError:
    base = status("VmHWM")
out = fn()
peak = status("VmHWM")
print(json.dumps({"base": base, "peak": peak, "nbytes": int(_harness.to_numpy(out).nbytes)}))
"""


def peak_memory(bench: str, method: str, *params) -> dict:
    """Run one call in a subprocess; returns base RSS, peak RSS and the output's size in bytes."""
    if not os.path.exists("/proc/self/status"):
        raise NotImplementedError("peak memory needs /proc (Linux)")
    BENCHES[bench].build(method, *params)  # NotImplementedError here rather than in the child
    parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `benchmarks` imports from
    arg = json.dumps({"bench": bench, "method": method, "params": [list(p) if isinstance(p, tuple) else p for p in params]})
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, parent, arg], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])
