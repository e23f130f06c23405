"""The experiments' optional dependencies, imported when first needed."""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> the name pip knows it by
_PIP_NAMES = {"torch": "torch", "matplotlib": "matplotlib", "sklearn": "scikit-learn", "scipy": "scipy",
              "threadpoolctl": "threadpoolctl"}  # scipy and threadpoolctl come with scikit-learn


def require(name: str) -> ModuleType:
    """The module ``name``, or an ImportError that says which package to install."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        package = _PIP_NAMES.get(name.split(".")[0], name)
        raise ImportError(f"blockhess.experiments needs {package}, which is not installed: "
                          f'pip install "blockhess[paper]"') from error
