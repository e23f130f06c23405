"""Command line: ``blockhess check`` (the main job) and ``python -m blockhess --cmakedir``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockhess", description=__doc__)
    parser.add_argument("--cmakedir", action="store_true", help="print the directory of blockhessConfig.cmake")
    parser.add_argument("--includedir", action="store_true", help="print the C++ include directory")
    parser.add_argument("--version", action="store_true", help="print the version")
    args, rest = parser.parse_known_args(argv)
    from . import __version__, get_cmake_dir, get_include

    if args.cmakedir:
        print(get_cmake_dir())
        return 0
    if args.includedir:
        print(get_include())
        return 0
    if args.version:
        print(__version__)
        return 0
    parser.print_help()
    return 0 if not rest else 2


if __name__ == "__main__":
    sys.exit(main())
