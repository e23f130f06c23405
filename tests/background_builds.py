"""The test suite's slow C++ builds, started when the session starts and run in the background.

The sanitizer build, the CPU kernel emulator and the README's C++ example take minutes of compiler
time, while most tests are single-threaded Python that leaves a core idle. conftest.py starts the
builds its selected tests need right after collection, one after another in a background thread,
and moves those tests to the end of the run; each test then waits for its build here (``result``).
The compilers run at the lowest CPU priority (``run``), so they take only what the other tests leave
and never slow them (timing tests included). Without the session's head start (a test run alone) a
test builds in the foreground, the same way.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from typing import Any, Callable

_NICE = ["nice", "-n", "19"] if shutil.which("nice") else []

_lock = threading.Lock()
_running: set[subprocess.Popen] = set()
_builds: dict[str, Future] = {}
_queue: list[tuple[Future, Callable[[], Any]]] = []
_scratch: list[str] = []
_worker: threading.Thread | None = None
_stopping = False


def run(cmd, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) at the lowest CPU priority; stopped by ``stop``."""
    with _lock:
        if _stopping:
            raise RuntimeError("the test session is over")
        proc = subprocess.Popen([*_NICE, *map(str, cmd)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **kwargs)
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        with _lock:
            _running.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def scratch_dir(name: str) -> str:
    """A new directory for a build's files, removed when the session ends (``stop``)."""
    path = tempfile.mkdtemp(prefix=f"blockhess-{name}-")
    with _lock:
        _scratch.append(path)
    return path


def _work() -> None:
    while True:
        with _lock:
            if not _queue or _stopping:
                return
            future, build = _queue.pop(0)
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(build())
        except BaseException as error:  # handed to the test that waits for it
            future.set_exception(error)


def start(name: str, build: Callable[[], Any]) -> None:
    """Queue ``build`` (run after the builds queued before it) under ``name``."""
    global _worker
    with _lock:
        if name in _builds or _stopping:
            return
        future: Future = Future()
        _builds[name] = future
        _queue.append((future, build))
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="background-builds", daemon=True)
            _worker.start()


def result(name: str, build: Callable[[], Any]) -> Any:
    """What the background build ``name`` returned (its exception raised), or ``build()`` now where
    none was started."""
    with _lock:
        future = _builds.get(name)
    return future.result() if future is not None else build()


def stop() -> None:
    """At the session's end: drop the builds not started and stop the compilers still running."""
    global _stopping
    with _lock:
        _stopping = True
        for future, _ in _queue:
            future.cancel()
        _queue.clear()
        for proc in _running:
            proc.kill()
        scratch = list(_scratch)
    for path in scratch:
        shutil.rmtree(path, ignore_errors=True)
