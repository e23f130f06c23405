"""The files that the command lines read and write, checked before anything is computed: each check
raises ValueError naming the option and the path, which the commands print as one line."""

from __future__ import annotations

import os
from typing import Any

_FALLBACK_NAME_MAX, _FALLBACK_PATH_MAX = 255, 4096  # Linux's, where pathconf cannot say


def _shown(path: str) -> str:
    """The path for a message: an over-long one shortened to its two ends."""
    return path if len(path) <= 200 else f"{path[:80]}...{path[-80:]}"


def _limit(folder: str, name: str, fallback: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return fallback


def _nearest_existing(path: str) -> str:
    """The deepest folder (or file) on the way to ``path`` that exists."""
    here = os.path.abspath(path)
    while not os.path.lexists(here):
        here = os.path.dirname(here)
    return here


def _read_only(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _check_name(path: str, option: str, what: str) -> None:
    """A name the file system can take: not empty, no NUL, within PATH_MAX and NAME_MAX (the limits of
    the nearest existing folder's file system)."""
    if not path:
        raise ValueError(f"{option} needs {what}, got an empty name")
    if "\0" in path:
        raise ValueError(f"{option} {_shown(path)!r}: the name contains a NUL character")
    encoded = os.fsencode(path)
    existing = _nearest_existing(path)
    path_max = _limit(existing, "PC_PATH_MAX", _FALLBACK_PATH_MAX)
    if len(encoded) >= path_max:  # PATH_MAX counts the terminating NUL
        raise ValueError(f"{option} {_shown(path)}: the path is {len(encoded)} bytes long, more than the system "
                         f"allows ({path_max - 1}, PATH_MAX)")
    name_max = _limit(existing if os.path.isdir(existing) else os.path.dirname(existing), "PC_NAME_MAX",
                      _FALLBACK_NAME_MAX)
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > name_max:
        raise ValueError(f"{option} {_shown(path)}: a name in it is {len(longest)} bytes long, more than the file "
                         f"system allows ({name_max}, NAME_MAX)")


def _check_can_create_in(folder: str, option: str, path: str) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {_shown(path)}: cannot create a file in {folder} (permission denied)")
    if _read_only(folder):
        raise ValueError(f"{option} {_shown(path)}: {folder} is on a read-only file system")


def _check_existing_file_writable(path: str, option: str, shown_as: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"{option} {_shown(shown_as)}: is a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {_shown(shown_as)}: the file is not writable (permission denied)")


def check_output_file(path: str, option: str) -> None:
    """``path`` can be written as a file: a valid name, not a directory, in an existing folder where the
    file can be created (or, existing, is writable). Nothing is created (the file is written after the
    computation)."""
    _check_name(path, option, "a file name")
    if path.endswith(os.sep):
        raise ValueError(f"{option} {_shown(path)}: a file name cannot end with {os.sep}")
    target = os.path.realpath(path)  # a symbolic link is written through
    _check_existing_file_writable(target, option, path)
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        existing = _nearest_existing(parent)
        if not os.path.isdir(existing):
            raise ValueError(f"{option} {_shown(path)}: {existing} is not a directory")
        raise ValueError(f"{option} {_shown(path)}: the directory {parent} does not exist")
    if os.path.exists(target):
        if _read_only(parent):
            raise ValueError(f"{option} {_shown(path)}: {parent} is on a read-only file system")
    else:
        _check_can_create_in(parent, option, path)


def check_output_folder(path: str, option: str, files: tuple[str, ...] = ()) -> None:
    """``path`` is a folder that exists or can be created (with its parents), and the ``files`` named
    can be written in it. Nothing is created."""
    _check_name(path, option, "a folder name")
    for name in files:
        _check_name(os.path.join(path, name), option, "a file name")
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{option} {_shown(path)}: a symbolic link to a folder that does not exist")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{option} {_shown(path)}: exists and is not a folder")
        _check_can_create_in(path, option, path)
        for name in files:
            _check_existing_file_writable(os.path.join(path, name), option, os.path.join(path, name))
        return
    existing = _nearest_existing(os.path.realpath(path))
    if not os.path.isdir(existing):
        raise ValueError(f"{option} {_shown(path)}: {existing} is not a folder")
    _check_can_create_in(existing, option, path)


def check_input_file(path: str, option: str) -> None:
    """``path`` is an existing regular file that can be read."""
    _check_name(path, option, "a file name")
    if not os.path.exists(path):
        raise ValueError(f"{option} {_shown(path)}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{option} {_shown(path)}: is a directory")
    if not os.path.isfile(path):  # a device or a pipe: reading it could block
        raise ValueError(f"{option} {_shown(path)}: not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option} {_shown(path)}: the file is not readable (permission denied)")


def load_module(path: str, option: str) -> Any:
    """The torch.nn.Module saved with ``torch.save`` in ``path`` (loading a pickle runs its code: only
    files one trusts). ValueError, one line, for a file that is missing or unreadable, that torch
    cannot load, or that holds something else (a state dict)."""
    import torch

    check_input_file(path, option)
    try:
        module = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - whatever torch.load makes of a file it cannot read
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"{option} {_shown(path)}: not a module saved with torch.save (torch.load: "
                         f"{type(err).__name__}{': ' + reason if reason else ''})") from None
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{option} {_shown(path)} holds a {type(module).__name__}, not a torch.nn.Module (save the "
                         "module itself: torch.save(model, path))")
    return module


def check_distinct(outputs: dict[str, str]) -> None:
    """No two options (option -> path) name the same file: the second write would replace the first."""
    seen: dict[Any, str] = {}
    for option, path in outputs.items():
        key = _identity(path)
        if key in seen:
            raise ValueError(f"{seen[key]} and {option} name the same file, {_shown(path)}")
        seen[key] = option


def _identity(path: str) -> Any:
    """The file an existing path names (hard links alike), else the path with links and .. resolved."""
    try:
        status = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (status.st_dev, status.st_ino)
