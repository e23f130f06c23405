"""Command line.

    blockhess check [options]        compute, verify and report a block's loss Hessian (the main job)
    blockhess --cmakedir             print the directory holding blockhessConfig.cmake
    blockhess --includedir           print the C++ include directory
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "check":
        from .check import main as check_main

        return check_main(argv[1:])
    parser = argparse.ArgumentParser(prog="blockhess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cmakedir", action="store_true", help="print the directory of blockhessConfig.cmake")
    parser.add_argument("--includedir", action="store_true", help="print the C++ include directory")
    parser.add_argument("--version", action="store_true", help="print the version")
    args = parser.parse_args(argv)
    from . import __version__, get_cmake_dir, get_include

    if args.cmakedir:
        print(get_cmake_dir())
    elif args.includedir:
        print(get_include())
    elif args.version:
        print(__version__)
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
