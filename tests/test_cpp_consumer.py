"""The "embed in C++" promise, against the installed package: a CMake project that finds blockhess
with find_package(blockhess CONFIG REQUIRED), computes a LayerNorm Jacobian with the core and checks
it against central finite differences computed in the C++ program itself."""

import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
]

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


def test_find_package_consumer_builds_and_checks_layernorm_jacobian(tmp_path):
    cmake_dir = subprocess.run(
        [sys.executable, "-m", "blockhess", "--cmakedir"], check=True, capture_output=True, text=True
    ).stdout.strip()
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(CMAKELISTS)
    (src / "main.cpp").write_text(MAIN_CPP)
    configure = ["cmake", "-S", str(src), "-B", str(build), f"-Dblockhess_DIR={cmake_dir}",
                 "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]

    def run(cmd):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    run(configure)
    run(["cmake", "--build", str(build)])
    exe = build / "consumer"
    out = run([str(exe)])
    assert "max |J - J_fd|" in out
