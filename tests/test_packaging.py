"""What a packager checks: the installed extension is portable (no -march=native unless asked for),
the distribution's metadata (licence, dependencies, extras, URLs) and the command line."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import blockhess
from blockhess import _core

ROOT = Path(__file__).resolve().parent.parent


def _deliberately_native() -> bool:
    """True when this build asked for -march=native through the environment (BLOCKHESS_NATIVE=ON)."""
    return os.environ.get("BLOCKHESS_NATIVE", "").strip().upper() in {"1", "ON", "TRUE", "YES"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockhess", *args], capture_output=True, text=True, timeout=120)


# ---- portability ---------------------------------------------------------------------------------


def test_build_info_is_a_read_only_record_of_the_build():
    info = _core.build_info
    assert isinstance(info["native"], bool)
    assert {"native", "build_type", "cplusplus"} <= set(info)
    with pytest.raises(TypeError):
        info["native"] = True  # type: ignore[index]


def test_installed_extension_is_portable():
    """The default build (what `pip install .` and a wheel build do) must not use -march=native: a
    wheel runs on CPUs other than the build machine's. BLOCKHESS_NATIVE=ON in the environment of the
    test run marks a deliberate native build, which this test then leaves alone."""
    if _core.build_info["native"] and _deliberately_native():
        pytest.skip("a deliberate -march=native build (BLOCKHESS_NATIVE=ON)")
    assert _core.build_info["native"] is False, (
        "blockhess._core was compiled with -march=native; wheels must be portable. Rebuild without "
        "-Ccmake.define.BLOCKHESS_NATIVE=ON (the default is OFF)."
    )


# The instruction-set levels of a dispatched build, lowest first (python/blockhess/_core.py).
LEVELS = ("portable", "x86_64_v3", "x86_64_v4")


def _best_level_this_cpu_runs(portable, cap: str = LEVELS[-1]) -> str:
    """The level the dispatch should load: the highest one, up to ``cap``, that this CPU runs and
    this install has (a build with BLOCKHESS_CPU_DISPATCH=OFF, or off x86-64, has only portable)."""
    for level in reversed(LEVELS[1:LEVELS.index(cap) + 1]):
        if getattr(portable, f"cpu_runs_{level}")() and importlib.util.find_spec(f"blockhess._core_{level}"):
            return level
    return "portable"


def _loaded_with(cpu: str) -> list[str]:
    code = "import blockhess; print(blockhess._core.build_info['isa']); print(blockhess._core.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "BLOCKHESS_CPU": cpu})
    return done.stdout.split()


def test_the_portable_core_is_always_there_and_the_dispatch_picks_one_this_cpu_runs():
    import blockhess

    if _core.build_info["native"]:
        pytest.skip("a deliberate -march=native build has only _core_native")
    portable = importlib.import_module("blockhess._core_portable")
    assert portable.build_info["isa"] == "portable"
    assert not (portable.cpu_runs_x86_64_v4() and not portable.cpu_runs_x86_64_v3())  # v4 contains v3
    if os.environ.get("BLOCKHESS_CPU", "auto").strip().lower() in ("", "auto"):
        assert _core.build_info["isa"] == _best_level_this_cpu_runs(portable)
    assert blockhess._core is _core
    # BLOCKHESS_CPU caps the level: portable forces the baseline, x86_64_v3 stops short of AVX-512.
    assert _loaded_with("portable") == ["portable", "blockhess._core_portable"]
    v3 = _best_level_this_cpu_runs(portable, cap="x86_64_v3")
    assert _loaded_with("x86_64_v3") == [v3, f"blockhess._core_{v3}"]
    best = _best_level_this_cpu_runs(portable)
    assert _loaded_with("auto") == [best, f"blockhess._core_{best}"]


def test_an_unknown_cpu_level_is_refused_by_name():
    if _core.build_info["native"]:
        pytest.skip("a deliberate -march=native build has only _core_native")
    done = subprocess.run([sys.executable, "-c", "import blockhess"], capture_output=True, text=True,
                          env={**os.environ, "BLOCKHESS_CPU": "avx9000"})
    assert done.returncode != 0
    assert "BLOCKHESS_CPU must be one of" in done.stderr and "'avx9000'" in done.stderr


_SAME_PROBLEM_ON_EVERY_LEVEL = """
import sys, numpy as np, blockhess
rng = np.random.default_rng(3)
params = blockhess.BlockParams.random(d=8, d_k=8, d_ff=16, seed=1)
X, T = rng.standard_normal((2, 24, 8)), rng.standard_normal((2, 24, 8))
v = rng.standard_normal(params.size)
f32 = blockhess.BlockParams.random(d=8, d_k=8, d_ff=16, seed=1, dtype=np.float32)
np.savez(sys.argv[1], isa=blockhess._core.build_info["isa"], H=blockhess.loss_hessian(X, T, params),
         hv=blockhess.loss_hvp(X, T, params, v),
         hv32=blockhess.loss_hvp(X.astype(np.float32), T.astype(np.float32), f32, v.astype(np.float32)))
"""


@pytest.mark.parametrize("level", LEVELS[1:])
def test_every_level_this_cpu_runs_gives_the_portable_results_to_rounding(level, tmp_path):
    """The instruction-set builds differ only in how the same sums are vectorised."""
    if _core.build_info["native"]:
        pytest.skip("a deliberate -march=native build has only _core_native")
    portable = importlib.import_module("blockhess._core_portable")
    if _best_level_this_cpu_runs(portable, cap=level) != level:
        pytest.skip(f"this CPU or this install has no {level} build")
    runs = {}
    for cpu in (level, "portable"):
        subprocess.run([sys.executable, "-c", _SAME_PROBLEM_ON_EVERY_LEVEL, str(tmp_path / cpu)], check=True,
                       env={**os.environ, "BLOCKHESS_CPU": cpu})
        runs[cpu] = np.load(tmp_path / f"{cpu}.npz")
    ours, base = runs[level], runs["portable"]
    assert (str(ours["isa"]), str(base["isa"])) == (level, "portable")
    assert np.array_equal(ours["H"], ours["H"].T)
    for key, tol in (("H", 1e-13), ("hv", 1e-13), ("hv32", 1e-5)):
        assert np.abs(ours[key] - base[key]).max() <= tol * np.abs(base[key]).max(), key


def test_pyproject_keeps_native_off_by_default():
    tomllib = pytest.importorskip("tomllib")
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source tree")
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    define = config["tool"]["scikit-build"]["cmake"]["define"]["BLOCKHESS_NATIVE"]
    assert define == {"env": "BLOCKHESS_NATIVE", "default": "OFF"}
    cmakelists = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    assert re.findall(r'option\(BLOCKHESS_NATIVE\s+"[^"]*"\s+(\w+)\)', cmakelists) == ["OFF"]


def _configure_top_level(tmp_path: Path, *defines: str) -> list[str]:
    """Configures the top-level project (CPU only, no build) and returns _core's compile commands."""
    pybind11 = pytest.importorskip("pybind11")
    build = tmp_path / "build"
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
           "-DBLOCKHESS_CUDA=OFF", f"-DPython_EXECUTABLE={sys.executable}",
           f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", *defines]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"configure failed:\n{proc.stdout}\n{proc.stderr}"
    entries = json.loads((build / "compile_commands.json").read_text())
    commands = [e.get("command") or " ".join(e["arguments"]) for e in entries if "/src/" in e["file"]]
    assert commands, "no compile commands for the binding sources"
    return commands


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_compile_commands_use_march_native_only_when_asked(tmp_path):
    if not (ROOT / "CMakeLists.txt").is_file():
        pytest.skip("not a source tree")
    default = _configure_top_level(tmp_path / "default")
    assert not any("-march=native" in c for c in default), "the default build compiles with -march=native"
    portable = [c for c in default if "_core_portable" in c]
    assert portable and not any("-march" in c for c in portable), "the baseline build must be portable"
    if platform.machine() in ("x86_64", "AMD64"):  # the dispatched AVX2/FMA and AVX-512 builds
        for level in ("3", "4"):
            assert any(f"-march=x86-64-v{level}" in c and f"_core_x86_64_v{level}" in c for c in default)
    native = _configure_top_level(tmp_path / "native", "-DBLOCKHESS_NATIVE=ON")
    core = [c for c in native if "core_module.cpp" in c]
    assert core and all("-march=native" in c and "_core_native" in c for c in core)


# ---- metadata ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist():
    return importlib.metadata.distribution("blockhess")


def test_licence_is_mit_with_its_file(dist):
    assert dist.metadata["License-Expression"] == "MIT"
    assert "LICENSE" in (dist.metadata.get_all("License-File") or [])
    text = dist.read_text("licenses/LICENSE") or dist.read_text("LICENSE")
    assert text and "MIT License" in text and "the blockhess developers" in text
    assert not [c for c in dist.metadata.get_all("Classifier") or [] if c.startswith("License ::")]


def _requirements(dist) -> dict[str | None, set[str]]:
    """Requirement names by extra (None: runtime), from lines such as 'tqdm>=4.60; extra == "cli"'."""
    out: dict[str | None, set[str]] = {}
    for line in dist.requires or []:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line).group(1).lower().replace("_", "-")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        out.setdefault(extra.group(1) if extra else None, set()).add(name)
    return out


def test_dependencies_and_extras(dist):
    reqs = _requirements(dist)
    assert reqs[None] == {"numpy", "tqdm"}, "runtime dependencies (cmeel-eigen belongs in the cpp extra)"
    assert "cmeel-eigen" in reqs["cpp"]
    assert {"cmeel-eigen", "hypothesis", "pytest", "torch"} <= reqs["test"]


def test_classifiers_keywords_and_urls(dist):
    classifiers = set(dist.metadata.get_all("Classifier") or [])
    for c in ("Programming Language :: Python :: 3", "Programming Language :: C++",
              "Topic :: Scientific/Engineering :: Mathematics",
              "Topic :: Scientific/Engineering :: Artificial Intelligence",
              "Operating System :: POSIX :: Linux", "Development Status :: 3 - Alpha"):
        assert c in classifiers
    assert "hessian" in (dist.metadata["Keywords"] or "")
    urls = dict(u.split(", ", 1) for u in dist.metadata.get_all("Project-URL") or [])
    assert {"Documentation", "Source", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())


# ---- command line --------------------------------------------------------------------------------


def test_cli_help_describes_the_program_and_lists_check():
    proc = _cli("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("usage: blockhess")
    assert "Hessians" in out and "Transformer" in out
    assert "check" in out and "--cmakedir" in out and "--includedir" in out and "--version" in out
    assert "Command line." not in out


def test_cli_without_arguments_prints_the_help():
    proc = _cli()
    assert proc.returncode == 0 and "check" in proc.stdout


def test_cli_version_and_paths():
    assert _cli("--version").stdout.strip() == blockhess.__version__
    cmakedir = Path(_cli("--cmakedir").stdout.strip())
    assert (cmakedir / "blockhessConfig.cmake").is_file()
    includedir = Path(_cli("--includedir").stdout.strip())
    assert (includedir / "blockhess" / "layernorm.hpp").is_file()


def test_cli_check_dispatches_to_the_check_command():
    proc = _cli("check", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: blockhess check" in proc.stdout
    # Global options before the command are accepted too.
    proc = _cli("--version", "check", "--help")
    assert proc.returncode == 0 and "usage: blockhess check" in proc.stdout


def test_cli_rejects_unknown_commands():
    proc = _cli("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
