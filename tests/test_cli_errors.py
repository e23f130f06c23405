"""The command lines refuse bad options and unusable files before computing anything (issue 25): one line
``blockhess <command>: error: ...`` on stderr, nothing on stdout, exit status 2. Run in-process through
``blockhess.__main__.main`` with every computation replaced by a failure, plus real runs of the console
script for the exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from blockhess import _check_config, check, report, spectrum_cli
from blockhess.__main__ import main

SMALL = ["--L", "5", "--d", "4", "--d-k", "3", "--d-ff", "6", "--quiet"]
BEYOND_MAX_SEED = str(2**32)
LONG_NAME = "n" * 300  # over NAME_MAX (255 on Linux's file systems)


def _over_path_max(folder) -> str:
    """A path into ``folder`` longer than PATH_MAX (4096), although its folder exists: "/." repeated."""
    return str(folder) + "/." * 2100


@pytest.fixture
def nothing_computed(monkeypatch):
    """Every command's computation fails the test if it is reached. torch, when installed, is imported
    first: check's reference and --module import it, which alone can take seconds."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass

    def refuse(*args, **kwargs):
        raise AssertionError("computed although an option was bad")

    monkeypatch.setattr(_check_config, "make_problem", refuse)
    for name in ("run_check", "loss_hessian"):
        monkeypatch.setattr(check, name, refuse)
    monkeypatch.setattr(spectrum_cli, "run", refuse)
    monkeypatch.setattr(report, "build", refuse)


def _refused(argv, capsys, prog) -> str:
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert elapsed < 10, elapsed  # refused at once
    return lines[0]


def _symlink(tmp_path, name, target):
    link = tmp_path / name
    link.symlink_to(target)
    return str(link)


def _existing(tmp_path, name):
    path = tmp_path / name
    path.write_text("")
    return path


def _folder_holding(tmp_path, entry):
    """An existing OUTDIR where ``entry``, a file the report writes, is a folder."""
    outdir = tmp_path / "out"
    (outdir / entry).mkdir(parents=True)
    return str(outdir)


# Each case: (argv after the command, a part of the message), built in a fresh tmp_path.
CHECK_CASES = {
    "seed beyond 2**32 - 1": lambda tmp: (["--seed", BEYOND_MAX_SEED], "--seed must be >= 0 and <= 4294967295"),
    "json name over NAME_MAX": lambda tmp: (["--json", str(tmp / LONG_NAME)], "NAME_MAX"),
    "json path over PATH_MAX": lambda tmp: (["--json", _over_path_max(tmp) + "/x.json"], "PATH_MAX"),
    "json name with NUL": lambda tmp: (["--json", str(tmp / "x\0.json")], "NUL"),
    "json name ending with /": lambda tmp: (["--json", str(tmp / "new") + "/"], "cannot end with /"),
    "json through a link to a missing folder": lambda tmp: (
        ["--json", _symlink(tmp, "link.json", tmp / "missing" / "x.json")], "does not exist"),
    "json and plot one file through a link": lambda tmp: (
        ["--json", str(_existing(tmp, "h.png")), "--plot", _symlink(tmp, "alias.png", tmp / "h.png")],
        "--json and --plot name the same file"),
    "json and plot one file through a hard link": lambda tmp: (
        ["--json", str(_existing(tmp, "h.json")), "--plot", _hard_link(tmp / "h.json", tmp / "h.png")],
        "--json and --plot name the same file"),
}


def _hard_link(existing, new):
    os.link(existing, new)
    return str(new)


def _state_dict(tmp):
    """A torch file that holds a state dict, not a module."""
    torch = pytest.importorskip("torch")
    path = tmp / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    return str(path)


def _not_a_torch_file(tmp):
    pytest.importorskip("torch")
    path = tmp / "notes.pt"
    path.write_text("not a pickle\n")
    return str(path)


SPECTRUM_CASES = {
    "negative seed": lambda tmp: (["--seed", "-1"], "--seed must be >= 0"),
    "seed beyond 2**32 - 1": lambda tmp: (["--seed", BEYOND_MAX_SEED], "--seed must be >= 0 and <= 4294967295"),
    "d 1 with eps 0": lambda tmp: (["--d", "1"], "--d 1 with --eps 0"),
    "json and density one file": lambda tmp: (["--json", str(tmp / "s.png"), "--density", str(tmp / "s.png")],
                                              "--json and --density name the same file"),
    "inputs beyond the memory budget": lambda tmp: (["--d", "100000"], "more than the memory budget"),
    "module not a torch file": lambda tmp: (["--module", _not_a_torch_file(tmp)], "not a module saved with torch.save"),
    "module holding no module": lambda tmp: (["--module", _state_dict(tmp)], "--module"),
    "json name over NAME_MAX": lambda tmp: (["--json", str(tmp / LONG_NAME)], "NAME_MAX"),
    "density path over PATH_MAX": lambda tmp: (["--density", _over_path_max(tmp) + "/d.png"], "PATH_MAX"),
    "json name with NUL": lambda tmp: (["--json", str(tmp / "x\0.json")], "NUL"),
}

REPORT_CASES = {
    "negative seed": lambda tmp: ([str(tmp / "out"), "--seed", "-1"], "--seed must be >= 0"),
    "seed beyond 2**32 - 1": lambda tmp: ([str(tmp / "out"), "--seed", BEYOND_MAX_SEED], "<= 4294967295"),
    "seed not an integer": lambda tmp: ([str(tmp / "out"), "--seed", "x"], "argument --seed: invalid int value"),
    "empty name": lambda tmp: ([""], "OUTDIR needs a folder name"),
    "folder under a file": lambda tmp: ([str(_existing(tmp, "file") / "out")], "is not a folder"),
    "OUTDIR a file": lambda tmp: ([str(_existing(tmp, "file"))], "exists and is not a folder"),
    "name over NAME_MAX": lambda tmp: ([str(tmp / LONG_NAME)], "NAME_MAX"),
    "path over PATH_MAX": lambda tmp: ([_over_path_max(tmp) + "/out"], "PATH_MAX"),
    "a file it writes is a folder": lambda tmp: ([_folder_holding(tmp, "report.md")], "is a directory"),
    "no OUTDIR": lambda tmp: ([], "the following arguments are required: OUTDIR"),
    "unknown option": lambda tmp: ([str(tmp / "out"), "--bogus"], "unrecognized arguments: --bogus"),
}


@pytest.mark.parametrize("case", CHECK_CASES)
def test_check_refuses_before_computing(case, tmp_path, capsys, nothing_computed):
    pytest.importorskip("matplotlib")  # --plot's format is checked
    argv, expected = CHECK_CASES[case](tmp_path)
    assert expected in _refused(["check", *SMALL, *argv], capsys, "blockhess check")


@pytest.mark.parametrize("case", SPECTRUM_CASES)
def test_spectrum_refuses_before_computing(case, tmp_path, capsys, nothing_computed):
    pytest.importorskip("matplotlib")  # --density's format is checked
    argv, expected = SPECTRUM_CASES[case](tmp_path)
    assert expected in _refused(["spectrum", *SMALL, *argv], capsys, "blockhess spectrum")


@pytest.mark.parametrize("case", REPORT_CASES)
def test_report_refuses_before_computing(case, tmp_path, capsys, nothing_computed):
    argv, expected = REPORT_CASES[case](tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert expected in _refused(["report", "--no-experiments", *argv], capsys, "blockhess report")
    assert sorted(tmp_path.rglob("*")) == before  # nothing created


@pytest.mark.parametrize("missing, argv, expected", [
    ("matplotlib", ["--no-experiments"], "matplotlib"),
    ("torch", [], "--no-experiments"),
    ("sklearn", [], "--no-experiments"),
])
def test_report_without_a_package_it_needs(missing, argv, expected, monkeypatch, tmp_path, capsys, nothing_computed):
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ImportError
    line = _refused(["report", str(tmp_path / "out"), *argv], capsys, "blockhess report")
    assert expected in line and "blockhess[paper]" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_folders_are_refused(tmp_path, capsys, nothing_computed):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    assert "permission denied" in _refused(["report", "--no-experiments", str(locked)], capsys, "blockhess report")
    assert "permission denied" in _refused(["report", "--no-experiments", str(locked / "a" / "b")], capsys,
                                           "blockhess report")
    assert "permission denied" in _refused(["spectrum", *SMALL, "--json", str(locked / "s.json")], capsys,
                                           "blockhess spectrum")
    unreadable = _existing(tmp_path, "block.pt")
    unreadable.chmod(0o200)
    assert "not readable" in _refused(["spectrum", *SMALL, "--module", str(unreadable)], capsys,
                                      "blockhess spectrum")


@pytest.mark.parametrize("argv, expected", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--version", "extra"], "invalid choice: 'extra'"),
])
def test_the_global_options_refuse_in_one_line(argv, expected, capsys):
    assert expected in _refused(argv, capsys, "blockhess")


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["spectrum", "--help"], ["report", "--help"]])
def test_help_is_still_help(argv, capsys, nothing_computed):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 0 and captured.out.startswith("usage: ") and captured.err == ""


# --- errors during a run ----------------------------------------------------------------------------------


def test_spectrum_out_of_memory_during_the_run_is_one_line(monkeypatch, capsys):
    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(spectrum_cli, "hessian_operator", exhausted)
    assert "out of memory" in _refused(["spectrum", *SMALL], capsys, "blockhess spectrum")


def test_spectrum_write_failure_after_the_run_is_one_line(monkeypatch, tmp_path, capsys):
    def disk_full(result, path):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(spectrum_cli, "plot_density", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        main(["spectrum", *SMALL, "-k", "2", "--probes", "1", "--steps", "5", "--density", str(tmp_path / "d.png")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "top eigenvalues" in captured.out
    assert captured.err == f"blockhess spectrum: error: cannot write {tmp_path / 'd.png'}: No space left on device\n"


def test_a_bug_in_the_spectrum_command_keeps_its_traceback(monkeypatch):
    # _block_traces called with the wrong arguments: a TypeError raised in spectrum_cli itself, a bug of
    # the command's, not an error about the data
    monkeypatch.setattr(spectrum_cli, "_block_traces", spectrum_cli._block_extremes)
    with pytest.raises(TypeError):
        main(["spectrum", *SMALL])


@pytest.mark.parametrize("command, entry", [("spectrum", "run"), ("report", "build")])
def test_interrupt_is_one_line(command, entry, monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(spectrum_cli if command == "spectrum" else report, entry, interrupted)
    argv = [*SMALL] if command == "spectrum" else [str(tmp_path / "out"), "--no-experiments", "--quiet"]
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([command, *argv])
    except KeyboardInterrupt:  # escaped as a traceback (and would end the test session)
        pytest.fail("the interrupt escaped the command")
    captured = capsys.readouterr()
    assert exit_info.value.code == 130 and captured.err == f"blockhess {command}: interrupted\n"


# --- the console script -------------------------------------------------------------------------------------


def _console_script() -> str:
    script = os.path.join(os.path.dirname(sys.executable), "blockhess")
    if not os.path.exists(script):
        pytest.skip("the blockhess console script is not installed next to this Python")
    return script


@pytest.mark.parametrize("argv", [
    lambda tmp: ["spectrum", *SMALL, "--json", str(tmp / "s.png"), "--density", str(tmp / "s.png")],
    lambda tmp: ["report", str(tmp / "out"), "--seed", "-1", "--no-experiments"],
], ids=["spectrum one file twice", "report negative seed"])
def test_console_script_exit_status(argv, tmp_path):
    done = subprocess.run([_console_script(), *argv(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockhess ") and ": error: " in lines[0], done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written
