"""The real CUDA kernels of ``cuda/src``, compiled for the CPU, in place of ``blockhess._cuda``.

``build()`` rewrites every ``cuda/src`` file into plain C++ (launch syntax and ``__shared__``
only; the kernel bodies are untouched), compiles it with ``tests/cuda_emulator/cuda_runtime.h`` in
place of the CUDA runtime and ``src/cuda_module.cpp`` (the real bindings) into an extension module,
and caches it under ``build/cuda-emulator/<hash of the sources>``. ``install()`` routes
``blockhess._gpu_launch`` to that module, with NumPy arrays standing in for device memory, so the
GPU orchestration and the kernels run together on any machine with a C++ compiler.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import background_builds
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).resolve().parent / "cuda_emulator"
FLAGS = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-DEIGEN_DONT_PARALLELIZE",
         "-U_FORTIFY_SOURCE"]  # fortified longjmp refuses to switch stacks

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(", re.S)
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+__align__\(\d+\)\s+unsigned char\s+(\w+)\[\];")


def translate(source: str) -> str:
    """CUDA C++ → C++ for the emulator: launches, shared memory and the __CUDACC__ guard."""
    out = _LAUNCH.sub(r"::blockhess_emu::launch(\1, \2)(", source)
    out = _DYNAMIC_SHARED.sub(r"unsigned char* \1 = ::blockhess_emu::dynamic_shared();", out)
    if re.search(r"extern\s+__shared__", out):
        raise RuntimeError("kernel_emulation.translate: cannot translate a dynamic shared array other than "
                           "`extern __shared__ __align__(N) unsigned char name[];`")
    out = out.replace("__shared__", "static thread_local").replace("defined(__CUDACC__)", "1")
    out = out.replace("#ifdef __CUDACC__", "#if 1").replace("#ifndef __CUDACC__", "#if 0")
    leftover = [token for token in ("<<<", "__shared__", "if __CUDACC__", "def __CUDACC__") if token in out]
    if leftover:
        raise RuntimeError(f"kernel_emulation.translate: cannot translate {leftover}")
    return out


def _inputs_hash(compiler: str, files: list[Path], edits: dict[str, str]) -> str:
    h = hashlib.sha256(" ".join([compiler, *FLAGS, *(f"{a}>{b}" for a, b in edits.items())]).encode())
    headers = sorted((ROOT / "cpp" / "include").rglob("*.hpp")) + sorted((ROOT / "cuda" / "include").rglob("*.hpp"))
    for path in [*files, *headers, SHIM / "cuda_runtime.h", Path(__file__)]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _build(name: str, cuda_dir: Path, cuda_files: list[Path], cpp_files: list[Path], extra_includes: list[Path],
           edits: dict[str, str] | None = None) -> Path:
    """Translates ``cuda_files`` (and the .cuh headers beside them), applies ``edits`` (each must
    match once), compiles them with ``cpp_files`` into the shared library ``name`` under
    build/cuda-emulator/<hash>/, unless it is there already."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} to build the CPU kernel emulator")
    edits = edits or {}
    headers = sorted(cuda_dir.glob("*.cuh"))
    out_dir = ROOT / "build" / "cuda-emulator" / _inputs_hash(compiler, [*cuda_files, *headers, *cpp_files], edits)
    library = out_dir / name
    if library.exists():
        return library
    work = out_dir / ("work-" + name)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    translated = {path: translate(path.read_text()) for path in [*headers, *cuda_files]}
    for old, new in edits.items():
        hits = [path for path, text in translated.items() if old in text]
        if len(hits) != 1 or translated[hits[0]].count(old) != 1:
            raise RuntimeError(f"kernel_emulation: the edit {old!r} matches {len(hits)} files, not exactly once")
        translated[hits[0]] = translated[hits[0]].replace(old, new)
    for header in headers:
        (work / header.name).write_text(translated[header])
    units = []
    for path in cuda_files:
        units.append(work / (path.stem + ".cpp"))
        units[-1].write_text(translated[path])
    units += cpp_files
    includes = [SHIM, ROOT / "cuda" / "include", ROOT / "cpp" / "include", *extra_includes]
    include_flags = [f"-I{p}" for p in includes]

    def compile_unit(unit: Path) -> Path:
        obj = work / (unit.stem + ".o")
        shared = None
        if unit in cpp_files:  # untranslated: the same object serves every variant (edits touch cuda/src only)
            key = _inputs_hash(compiler + " ".join(include_flags), [unit], {})
            shared = ROOT / "build" / "cuda-emulator" / "objects" / f"{unit.stem}-{key}.o"
            if shared.exists():
                return shared
        done = background_builds.run([compiler, *FLAGS, *include_flags, "-c", unit, "-o", obj])
        if done.returncode != 0:
            raise RuntimeError(f"compiling {unit.name} for the CPU kernel emulator failed:\n{done.stderr}")
        if shared is not None:
            shared.parent.mkdir(parents=True, exist_ok=True)
            partial = shared.with_suffix(f".{os.getpid()}.partial")
            shutil.copyfile(obj, partial)
            partial.replace(shared)  # atomic: a concurrent build never links half an object
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_unit, units))
    partial = work / (name + ".partial")
    done = background_builds.run([compiler, "-shared", *objects, "-o", partial])
    if done.returncode != 0:
        raise RuntimeError(f"linking the CPU kernel emulator failed:\n{done.stderr}")
    partial.replace(library)  # atomic: a concurrent run never sees half a library
    return library


# The launchers' grid limit lowered to 3 blocks, so that grid-stride loops go round at test sizes.
SMALL_GRID = {"kMaxGridX = 1u << 20;": "kMaxGridX = 3u;"}


def build(max_grid_x: int | None = None) -> Path:
    """The emulated ``_cuda`` extension module: cuda/src with the real bindings (src/cuda_module.cpp).

    ``max_grid_x`` lowers the launchers' grid limit (2**20 blocks) so that the kernels' grid-stride
    loops go round several times at test sizes, as they do on the GPU only beyond a million rows.
    """
    import pybind11

    cuda_dir = ROOT / "cuda" / "src"
    edits = {next(iter(SMALL_GRID)): f"kMaxGridX = {int(max_grid_x)}u;"} if max_grid_x else None
    return _build("_cuda" + sysconfig.get_config_var("EXT_SUFFIX"), cuda_dir, _kernel_sources(),
                  [ROOT / "src" / "cuda_module.cpp", ROOT / "src" / "cuda_block.cpp", ROOT / "src" / "cuda_components.cpp",
                   SHIM / "cublas.cpp"],
                  [ROOT / "src", Path(pybind11.get_include()), Path(sysconfig.get_paths()["include"]), eigen_include()],
                  edits)


def _kernel_sources() -> list[Path]:
    """cuda/src's files, less its cuBLAS loader: the emulator links the stand-in (cuda_emulator/cublas.cpp)."""
    return [path for path in sorted((ROOT / "cuda" / "src").glob("*.cu")) if path.name != "cublas.cu"]


def build_backend_probe(edits: dict[str, str] | None = None) -> Path:
    """The GPU backend (cuda/src/backend.cu) with the cuBLAS stand-in and the C entry points of
    cuda_emulator/backend_probe.cpp, as a plain shared library; ``edits`` make a deliberately broken
    variant (tests/test_gpu_backend.py)."""
    cuda_dir = ROOT / "cuda" / "src"
    return _build("backend_probe.so", cuda_dir, [cuda_dir / "backend.cu", cuda_dir / "runtime.cu"],
                  [SHIM / "cublas.cpp", SHIM / "backend_probe.cpp"], [eigen_include()], edits)


def eigen_include() -> Path:
    """Eigen 3.4's headers (cmeel-eigen, part of the test extra): the engine in src/cuda_block.cpp needs them."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        path = Path(base) / "cmeel.prefix" / "include" / "eigen3"
        if (path / "Eigen" / "Core").is_file():
            return path
    raise RuntimeError("Eigen 3.4 headers not found for the CPU kernel emulator (pip install cmeel-eigen)")


def build_selftest() -> Path:
    """tests/cuda_emulator/selftest.cu (kernels with known defects) as a plain shared library."""
    return _build("selftest.so", SHIM, [SHIM / "selftest.cu"], [], [])


def build_all() -> None:
    """Every variant the tests load: the module, its small-grid variant, the self-test and the backend probe."""
    build()
    build(max_grid_x=3)
    build_selftest()
    build_backend_probe()
    build_backend_probe(edits=SMALL_GRID)


# The mark of a test that loads the emulator: its build starts with the session (tests/conftest.py).
needs_emulator = pytest.mark.background_build("kernel emulator", build_all)


def load(max_grid_x: int | None = None):
    """The emulated module (built if needed), named ``_cuda`` like the real one."""
    path = build(max_grid_x)
    spec = importlib.util.spec_from_file_location("_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class EmulatedKernels:
    """The launch hooks of ``blockhess._gpu_launch`` pointed at the emulated module."""

    def __init__(self, module) -> None:
        self.module = module
        self.calls: list[str] = []

    @staticmethod
    def pointer(a) -> int:
        if a is None:
            return 0
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous, "kernels only ever see C-contiguous arrays"
        return int(a.__array_interface__["data"][0])

    def function(self, name: str, dtype):
        kernel = getattr(self.module, name + {4: "_f32", 8: "_f64"}[np.dtype(dtype).itemsize])

        def call(*args, **kwargs):
            self.calls.append(name)
            return kernel(*args, **kwargs)

        return call


def install(monkeypatch, module) -> EmulatedKernels:
    """Route blockhess._gpu_launch to the emulated kernels; returns the hooks (``.calls`` lists launches)."""
    from blockhess import _gpu_launch

    hooks = EmulatedKernels(module)
    monkeypatch.setattr(_gpu_launch, "_ptr", hooks.pointer)
    monkeypatch.setattr(_gpu_launch, "_stream", lambda: 0)
    monkeypatch.setattr(_gpu_launch, "_fn", hooks.function)
    return hooks


if __name__ == "__main__":  # python tests/kernel_emulation.py: build and print the module path
    print(build())
    sys.exit(0)
