"""The C++ core under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer.

Builds tests/cpp (core_sanitize*.cpp against this source tree's cpp/, at -O1, one translation unit
per scalar type, built in parallel) and runs it: every public header of the core at several shapes,
float and double, on the core's thread pool. Marked slow (a build of two to four minutes on 2
cores) but run in CI; skipped where cmake, a C++ compiler, the sanitizer runtimes or Eigen are
missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import background_builds
import pytest

pytestmark = pytest.mark.slow

SOURCE = Path(__file__).resolve().parent / "cpp"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)


def build_sanitizer() -> tuple[str, str]:
    """Configures and builds tests/cpp in a directory of the session's; (outcome, detail): ("built",
    the directory), ("skip", why) or ("fail", the log). Run in the background (tests/conftest.py)."""
    build = background_builds.scratch_dir("sanitize")
    configure = ["cmake", "-S", SOURCE, "-B", build, f"-DPython_EXECUTABLE={sys.executable}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    env = dict(os.environ)
    env.setdefault("CXX", _compiler())
    proc = background_builds.run(configure, env=env, timeout=300)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if "BLOCKHESS_SANITIZERS_UNAVAILABLE" in log:
            return "skip", "the compiler cannot build with -fsanitize=address,undefined (no sanitizer runtime)"
        if "Eigen3" in log and "Could not find" in log:
            return "skip", "Eigen 3.4 not found (pip install cmeel-eigen, part of the test extra)"
        return "fail", f"configure failed:\n{log}"
    proc = background_builds.run(["cmake", "--build", build], timeout=900)
    if proc.returncode != 0:
        return "fail", f"build failed:\n{proc.stdout}\n{proc.stderr}"
    return "built", str(build)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
@pytest.mark.skipif(sys.platform != "linux", reason="the sanitizer build is set up for Linux toolchains")
@pytest.mark.skipif(not (SOURCE / "CMakeLists.txt").is_file(), reason=f"no {SOURCE} (not a source tree)")
@pytest.mark.background_build("sanitizer", build_sanitizer)
def test_core_under_address_and_undefined_behaviour_sanitizers():
    outcome, detail = background_builds.result("sanitizer", build_sanitizer)
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome == "built", detail
    build = Path(detail)

    env = dict(os.environ)
    exe = build / "core_sanitize"
    env.update(
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        LSAN_OPTIONS=env.get("LSAN_OPTIONS", ""),
    )
    # The program sets its own thread counts; keep the environment from overriding the default.
    env.pop("BLOCKHESS_NUM_THREADS", None)
    proc = _run([exe], env=env, timeout=600)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "LeakSanitizer does not work under ptrace" in out:
        # LSan cannot run under a debugger or strace; everything else still can.
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
        proc = _run([exe], env=env, timeout=600)
        out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"core_sanitize failed (exit {proc.returncode}):\n{out[-20000:]}"
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out[-20000:]
    assert "0 failed" in proc.stdout, out[-20000:]
