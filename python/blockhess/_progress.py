"""The progress bar of ``blockhess check``: one bar over the whole run, on a terminal only."""

from __future__ import annotations

import sys


class Progress:
    """One progress bar over the whole run, on stderr and only when stderr is a terminal.

    tqdm is imported only when a bar is shown; without it, a line per phase instead. Disabled, it
    prints nothing at all."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._lines = False  # tqdm missing: one line per phase

    def start(self, total: int, description: str = "") -> None:
        if not self.enabled or self._bar is not None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._lines = True
            return
        self._bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False, dynamic_ncols=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")

    def phase(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)
        elif self._lines:
            print(f"[blockhess] {text}", file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def note(self, text: str) -> None:
        """A message after the run (a file written): shown on a terminal only."""
        if self.enabled:
            print(f"[blockhess] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __bool__(self) -> bool:
        return self.enabled
