"""The blockhess command line (``blockhess`` or ``python -m blockhess``).

    blockhess check [options]        compute, verify and report a block's loss Hessian (the main job)
    blockhess spectrum [options]     per-block traces, extreme eigenvalues and the spectral density
    blockhess report OUTDIR          the paper's bounds, scaling claims and experiments, as a report
    blockhess approximations         K-FAC-style, diagonal and layer-wise curvature against the exact matrix
    blockhess --cmakedir             print the directory holding blockhessConfig.cmake
    blockhess --includedir           print the C++ include directory
    blockhess --version              print the version
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
blockhess: exact, closed-form Jacobians and Hessians of full (post-LN) Transformer blocks,
computed by a C++ core (optional CUDA kernels) behind a NumPy/CuPy API.

From the command line it runs its main job, `blockhess check`: the exact loss Hessian of a
Transformer block (the paper's MNIST block by default), verified against PyTorch autograd or
finite differences, with a per-block report. --cmakedir and --includedir serve C++ programs
built against the installed package (find_package(blockhess) in CMake)."""

EPILOG = """\
examples:
  blockhess check                          the MNIST block (L=49, d=16, d_k=16, d_ff=64) vs torch
  blockhess check --L 8 --d 8 --batch 2    a smaller block, a batch of two
  blockhess check --help                   every option of the check
  blockhess spectrum --density d.png       traces, eigenvalues and the spectral density, no dense H
  blockhess report out --quick             the paper's bounds (stated vs corrected), scaling, experiments
  blockhess approximations                 Kronecker / diagonal / layer-wise curvature vs the exact matrix
  cmake -Dblockhess_DIR="$(blockhess --cmakedir)" ...
"""


def build_parser() -> argparse.ArgumentParser:
    from ._command_line import ArgumentParser  # errors as one line, as every command's

    parser = ArgumentParser(
        prog="blockhess",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cmakedir", action="store_true", help="print the directory of blockhessConfig.cmake")
    parser.add_argument("--includedir", action="store_true", help="print the C++ include directory")
    parser.add_argument("--version", action="store_true", help="print the version")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    # The check has its own parser (blockhess.check.main); this entry only lists it and hands over.
    check = commands.add_parser(
        "check",
        add_help=False,
        help="compute, verify and report a block's loss Hessian (the main job); "
        "`blockhess check --help` lists its options",
    )
    spectrum = commands.add_parser(
        "spectrum",
        add_help=False,
        help="per-block exact traces and extreme eigenvalues, the spectral density, without the dense "
        "Hessian; `blockhess spectrum --help` lists its options",
    )
    report = commands.add_parser(
        "report",
        add_help=False,
        help="the paper's bounds as stated and corrected against exact norms, its scaling claims measured, "
        "its experiments on scikit-learn's digits; `blockhess report --help` lists its options",
    )
    approximations = commands.add_parser(
        "approximations",
        add_help=False,
        help="Kronecker-factored, diagonal and layer-wise approximations of a ViT's or a language model's curvature "
        "against its exact Gauss-Newton matrix and Hessian; `blockhess approximations --help` lists its options",
    )
    del check, spectrum, report, approximations
    return parser


def _run_spectrum(argv: list[str]) -> int:
    from .spectrum_cli import main as spectrum_main

    return spectrum_main(argv)


def _run_report(argv: list[str]) -> int:
    from .report import main as report_main

    return report_main(argv)


def _run_approximations(argv: list[str]) -> int:
    from .approximations_cli import main as approximations_main

    return approximations_main(argv)


def _run_check(argv: list[str]) -> int:
    from .check import main as check_main

    return check_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"check": _run_check, "spectrum": _run_spectrum, "report": _run_report,
                "approximations": _run_approximations}
    if argv and argv[0] in commands:  # everything after it belongs to the command's own parser
        return commands[argv[0]](argv[1:])
    parser = build_parser()
    # The global options take no values, so the first word that is not an option is the command.
    first = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if first is not None and argv[first] in commands:
        parser.parse_args(argv[:first])  # rejects unknown global options (and answers --help)
        return commands[argv[first]](argv[first + 1:])
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
