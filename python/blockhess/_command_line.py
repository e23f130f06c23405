"""What every command line (check, spectrum, report) shares: the one-line usage errors, argparse
that reports them, negative numbers as option values, Ctrl-C and a closed pipe without a traceback,
errors in the data and failed writes as one line, and the checks of --seed and the output files."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from . import _command_files


# The largest --seed: numpy's legacy seeding and scikit-learn's random_state (the report's experiments)
# take seeds up to 2**32 - 1; every command takes the same range.
MAX_SEED = 2**32 - 1


class UsageError(Exception):
    """A bad option or combination: reported as one line and exit status 2, before any computation."""


def check_seed(seed: int) -> None:
    """--seed within 0 .. MAX_SEED: UsageError."""
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be >= 0 and <= {MAX_SEED} (2**32 - 1), got {seed}")


def check_outputs(outputs: dict[str, str | None]) -> None:
    """The output files asked for (option -> path, None where not asked for) can be written, each to a
    path of its own (blockhess._command_files); UsageError otherwise. Nothing is created."""
    asked = {option: path for option, path in outputs.items() if path is not None}
    try:
        for option, path in asked.items():
            _command_files.check_output_file(path, option)
        _command_files.check_distinct(asked)
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_plot_format(path: str, option: str) -> None:
    """matplotlib is installed and writes the format of ``path``'s extension."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError(f"{option} needs matplotlib: pip install 'blockhess[plot]'") from None
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise UsageError(f"{option} {path}: matplotlib cannot write .{extension} files "
                         f"(it writes {', '.join('.' + f for f in sorted(formats))})")


# The command lines: an error raised in them is a bug of theirs, not one about the data.
_COMMANDS = ("blockhess.__main__", "blockhess.check", "blockhess.spectrum_cli", "blockhess.report",
             "blockhess._command_line", "blockhess._check_config", "blockhess._check_references",
             "blockhess._check_comparison", "blockhess._check_memory", "blockhess._check_report",
             "blockhess._progress", "blockhess.approximations_cli")


def raised_by_blockhess(err: BaseException) -> bool:
    """True when the innermost frame of ``err`` is blockhess's own code outside the command lines (its
    input validation, or the C++ core called from it): an error about the data, not a bug there."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module.startswith("blockhess.") and module not in _COMMANDS


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``blockhess check: error: ...`` (no usage block), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


_NUMERIC_OPTIONS = ("--L", "--d", "--d-k", "--d-ff", "--batch", "--seed", "--eps", "--heads", "--classes")


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """``--eps -1e-3`` -> ``--eps=-1e-3``: argparse takes only plain negative numbers such as -1 for
    values, so a negative value in another form would get a puzzling "expected one argument"."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            out += argv[i:]
            break
        if word in _NUMERIC_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{word}={argv[i + 1]}")
                i += 2
                continue
        out.append(word)
        i += 1
    return out


def run_command(prog: str, command: Callable[[list[str]], int], argv: list[str]) -> int:
    """``command(argv)`` with Ctrl-C (SystemExit(130), one line) and a reader that goes away
    (SystemExit(141)) ended without a traceback."""
    try:
        return command(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except BrokenPipeError:  # e.g. blockhess check | head: nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise SystemExit(141) from None


@contextlib.contextmanager
def errors_in_the_data(parser: argparse.ArgumentParser, out_of_memory_hint: str = "") -> Iterator[None]:
    """An error that blockhess raises about the data during a run (ValueError, TypeError, and their
    subclasses OutputTooLargeError and NonFiniteError) as one line, parser.error (exit status 2); a bug
    keeps its traceback. Running out of memory (the estimates are generous, but machines are shared)
    is one line too."""
    try:
        yield
    except (ValueError, TypeError) as err:
        if not raised_by_blockhess(err):
            raise
        parser.error(str(err))
    except MemoryError as err:
        parser.error(f"out of memory ({err or 'an allocation failed'}); use smaller sizes{out_of_memory_hint}")


@contextlib.contextmanager
def writing_outputs(parser: argparse.ArgumentParser) -> Iterator[None]:
    """A write that fails although its path was checked (a full disk, a file system that lies about
    permissions) as one line, parser.error (exit status 2)."""
    try:
        yield
    except OSError as err:
        parser.error(f"cannot write {err.filename or 'the output'}: {err.strerror or err}")
