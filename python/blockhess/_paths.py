"""Where the installed C++ headers and CMake package live (for C++ consumers)."""

from __future__ import annotations

from importlib.resources import files


def _installed(relative: str) -> str:
    # joinpath also resolves editable installs, whose package spans the source and install trees.
    return str(files("blockhess").joinpath(relative))


def get_include() -> str:
    """Directory holding ``blockhess/*.hpp`` (add it to the include path)."""
    return _installed("include")


def get_cmake_dir() -> str:
    """Directory holding ``blockhessConfig.cmake`` (pass it as ``-Dblockhess_DIR=...``)."""
    return _installed("share/cmake/blockhess")
