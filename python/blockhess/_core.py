"""The CPU extension: the build for this processor's instruction set.

The wheel carries the core compiled for the platform's baseline (``_core_portable``) and, on
x86-64, again for x86-64-v3 (AVX2 + FMA: ``_core_x86_64_v3``), so it runs on any CPU of its
platform and still uses the wide vector units where they exist. A ``BLOCKHESS_NATIVE=ON`` build has
only ``_core_native``. ``BLOCKHESS_CPU=portable`` in the environment forces the baseline build.
This module replaces itself with the chosen extension: ``blockhess._core`` *is* that module, and
``blockhess._core.build_info["isa"]`` says which one it is.
"""

from __future__ import annotations

import importlib
import os
import sys


def _load():
    def load(level: str):
        return importlib.import_module(f"{__package__}._core_{level}")

    for level in ("native",):  # a -march=native build is the only CPU extension of its install
        try:
            return load(level)
        except ImportError:
            pass
    portable = load("portable")
    forced = os.environ.get("BLOCKHESS_CPU", "").strip().lower()
    if forced not in ("", "portable", "auto"):
        raise ImportError(f"BLOCKHESS_CPU must be 'portable' or 'auto', got {forced!r}")
    if forced != "portable" and portable.cpu_runs_x86_64_v3():
        try:
            return load("x86_64_v3")
        except ImportError:  # a build without it (BLOCKHESS_CPU_DISPATCH=OFF, or not x86-64)
            pass
    return portable


sys.modules[__name__] = _load()
