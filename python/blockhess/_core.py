"""The CPU extension: the build for this processor's instruction set.

The wheel carries the core compiled for the platform's baseline (``_core_portable``) and, on
x86-64, again for x86-64-v3 (AVX2 + FMA: ``_core_x86_64_v3``) and for x86-64-v4 (AVX-512:
``_core_x86_64_v4``), so it runs on any CPU of its platform and still uses the widest vector units
it has. A ``BLOCKHESS_NATIVE=ON`` build has only ``_core_native``. ``BLOCKHESS_CPU`` in the
environment caps the level: ``portable`` forces the baseline build, ``x86_64_v3`` stops short of
AVX-512, ``auto`` (or unset) takes the best this CPU runs. This module replaces itself with the
chosen extension: ``blockhess._core`` *is* that module, and ``blockhess._core.build_info["isa"]``
says which one it is.
"""

from __future__ import annotations

import importlib
import os
import sys

# The dispatched levels, lowest first; the portable build checks whether this CPU runs each.
_LEVELS = ("portable", "x86_64_v3", "x86_64_v4")


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
    if forced not in ("", "auto", *_LEVELS):
        raise ImportError(f"BLOCKHESS_CPU must be one of 'auto', {', '.join(map(repr, _LEVELS))}, got {forced!r}")
    cap = _LEVELS.index(forced) if forced in _LEVELS else len(_LEVELS) - 1
    for level in reversed(_LEVELS[1:cap + 1]):
        if getattr(portable, f"cpu_runs_{level}")():
            try:
                return load(level)
            except ImportError:  # a build without it (BLOCKHESS_CPU_DISPATCH=OFF, not x86-64, an old compiler)
                pass
    return portable


sys.modules[__name__] = _load()
