"""The "embed in C++" promise, against the installed package: CMake projects that find blockhess with
find_package(blockhess CONFIG REQUIRED) and build with it.

- The README's example ("Using the C++ core": its ```cmake and ```cpp blocks, taken verbatim from the
  README of this source tree) must configure, compile and run as written.
- A consumer that computes a LayerNorm Jacobian with the core and checks it against central finite
  differences computed in the C++ program itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import background_builds
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
]

README = Path(__file__).resolve().parent.parent / "README.md"

CMAKELISTS = """\
cmake_minimum_required(VERSION 3.24)
project(blockhess_consumer LANGUAGES CXX)
find_package(blockhess CONFIG REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE blockhess::core)
"""

MAIN_CPP = r"""
#include <blockhess/layernorm.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using blockhess::index_t;
  namespace ln = blockhess::layernorm;
  const index_t L = 3, d = 5;
  const double eps = 1e-3;
  std::vector<double> X(L * d), gamma(d), beta(d);
  for (index_t k = 0; k < L * d; ++k) X[k] = std::sin(1.3 * k + 0.2) + 0.1 * k;
  for (index_t a = 0; a < d; ++a) gamma[a] = 0.5 + 0.3 * a, beta[a] = 0.1 * a;  // J is not symmetric

  std::vector<double> y(L * d), sigma(L), J(L * d * d);
  ln::normalize(X.data(), L, d, eps, y.data(), sigma.data());
  ln::jacobian_blocks(y.data(), sigma.data(), gamma.data(), L, d, J.data());

  // Central differences of the forward pass; entries outside the diagonal blocks must vanish.
  const double h = 1e-6;
  double worst = 0, largest = 0;
  std::vector<double> Zp(L * d), Zm(L * d), s(L);
  for (index_t i = 0; i < L; ++i)
    for (index_t b = 0; b < d; ++b) {
      std::vector<double> Xp = X, Xm = X;
      Xp[i * d + b] += h;
      Xm[i * d + b] -= h;
      ln::forward(Xp.data(), L, d, eps, gamma.data(), beta.data(), Zp.data(), s.data());
      ln::forward(Xm.data(), L, d, eps, gamma.data(), beta.data(), Zm.data(), s.data());
      for (index_t r = 0; r < L; ++r)
        for (index_t a = 0; a < d; ++a) {
          const double fd = (Zp[r * d + a] - Zm[r * d + a]) / (2 * h);
          const double exact = r == i ? J[(i * d + a) * d + b] : 0.0;
          worst = std::max(worst, std::abs(fd - exact));
          largest = std::max(largest, std::abs(exact));
        }
    }
  std::printf("max |J - J_fd| = %.3g (max |J| = %.3g)\n", worst, largest);
  return (largest > 0.1 && worst < 1e-7 * largest) ? 0 : 1;
}
"""


def readme_block(lang: str) -> str:
    """The text of the README's only ```lang fenced block (its section "Using the C++ core")."""
    if not README.is_file():
        pytest.skip(f"no README.md next to the tests ({README}): not a source tree")
    blocks = re.findall(rf"^```{lang}[ \t]*\n(.*?)^```[ \t]*$", README.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, f"README.md should have exactly one ```{lang} block, found {len(blocks)}"
    return blocks[0]


def cmake_dir() -> str:
    return subprocess.run(
        [sys.executable, "-m", "blockhess", "--cmakedir"], check=True, capture_output=True, text=True
    ).stdout.strip()


def run(cmd, **kwargs) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def build_consumer(directory: Path, cmakelists: str, main_cpp: str) -> Path:
    """Configures and builds a consumer project against the installed package; returns its build dir."""
    src, build = directory / "src", directory / "build"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(cmakelists)
    (src / "main.cpp").write_text(main_cpp)
    configure = ["cmake", "-S", src, "-B", build, f"-Dblockhess_DIR={cmake_dir()}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for step in (configure, ["cmake", "--build", build]):
        proc = background_builds.run(step)
        assert proc.returncode == 0, f"{step} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return build


def build_readme_example() -> Path:
    """The README's example built in a directory of the session's (in the background: tests/conftest.py)."""
    return build_consumer(Path(background_builds.scratch_dir("readme-example")), readme_block("cmake"),
                          readme_block("cpp"))


def executable(build: Path, name: str) -> Path:
    exe = build / name
    assert exe.is_file() and os.access(exe, os.X_OK), f"no executable {name} in {build}"
    return exe


@pytest.mark.background_build("README C++ example", build_readme_example)
def test_readme_cpp_example_builds_and_runs_as_written():
    cmakelists, program = readme_block("cmake"), readme_block("cpp")
    assert "find_package(blockhess CONFIG REQUIRED)" in cmakelists
    assert "int main(" in program, "the README's C++ example must be a complete program"
    names = re.findall(r"add_executable\((\w+)", cmakelists)
    assert len(names) == 1, "the README's CMake example should build exactly one program"
    build = background_builds.result("README C++ example", build_readme_example)
    out = run([executable(build, names[0])])
    # The paper's block at L=4, d=3, d_k=2, d_ff=5: P = 6 + 6 + 9 + 15 + 15. Its dense Hessian is
    # symmetric by construction (bit for bit), and the operator's H 1 equals the dense row sums.
    found = re.search(r"loss ([0-9.]+), P = (\d+), max \|H - H\^T\| = (\S+), max \|H 1 - op\(1\)\| = (\S+)", out)
    assert found, out
    loss, P, asymmetry, gap = float(found[1]), int(found[2]), float(found[3]), float(found[4])
    assert P == 51 and loss > 0.1 and asymmetry == 0.0 and gap < 1e-12, out


def test_find_package_consumer_builds_and_checks_layernorm_jacobian(tmp_path):
    build = build_consumer(tmp_path, CMAKELISTS, MAIN_CPP)
    out = run([executable(build, "consumer")])
    assert "max |J - J_fd|" in out
