#!/usr/bin/env bash
# The whole GPU verification in one go, for a GPU machine without network (H200, sm_90):
#
#     bash benchmarks/gpu_check.sh OUTDIR
#
#  1. builds and installs blockhess with the CUDA kernels:
#       python3 -m pip install --no-build-isolation --no-deps .   (BLOCKHESS_CUDA=ON)
#     The C++ core needs Eigen 3.4 headers at build time. A GPU machine without network has no
#     cmeel-eigen, so prepare the wheel beforehand, on a machine with network:
#         bash benchmarks/prepare_gpu_wheels.sh
#     (pip download --no-deps -d benchmarks/wheels cmeel-eigen cmeel), and copy benchmarks/wheels/
#     (ignored by git) to the GPU machine with the checkout. The cmeel-eigen wheel found there is
#     unpacked (it is a zip; nothing is installed) and handed to CMake as Eigen3_DIR. Without it, an
#     installed cmeel-eigen or a system Eigen 3.4 is used if CMake finds one.
#  2. runs the GPU tests: pytest -m cuda (tests/test_cuda.py: every GPU result against the CPU
#     core and torch CUDA autograd, the bad-input tests on device arrays);
#  3. runs the GPU benchmark (benchmarks/gpu_bench.py): LayerNorm Jacobian-blocks bandwidth vs a
#     device-to-device copy, full block loss Hessian vs torch.func.hessian on the same GPU, and the
#     GPU engine's Hessian-vector products (GPT-2-shaped block, 4-block stack) vs a torch gradient
#     and torch's double-backward HVP;
#  4. compute-sanitizer memcheck and racecheck over a selection of the GPU tests (SANITIZE_TESTS);
#  5. if time is left, the rest of the test suite (informational).
# Everything goes to OUTDIR/log.txt; OUTDIR/results.md has the summary and the results table.
# The whole run stays under 8 minutes (each stage has a time limit; override the total with
# GPU_CHECK_BUDGET=seconds). Exit status: 0 when the build and the GPU tests pass.
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_check.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-450}"  # seconds for all stages (8 min = 480; keep a margin)
START=$(date +%s)
LOG="$OUT/log.txt"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONDONTWRITEBYTECODE=1
export PIP_BREAK_SYSTEM_PACKAGES=1  # a system interpreter (PEP 668) is fine here; harmless in a venv

left() { echo $((BUDGET - ($(date +%s) - START))); }
stage_limit() {  # min(cap, time left - reserve), at least 10 s
  local cap=$1 reserve=$2 l
  l=$(($(left) - reserve))
  [ "$l" -gt "$cap" ] && l=$cap
  [ "$l" -lt 10 ] && l=10
  echo "$l"
}
banner() { echo; echo "==== [$(($(date +%s) - START)) s] $* ===="; }

SANITIZE_TESTS="${SANITIZE_TESTS:-cupy and (layernorm_gpu_matches_cpu and 16-256 or softmax_gpu or commutation_gpu \
or attention_gpu or ffn_gpu or block_gpu_matches_cpu and mse or output_hessian or non_finite \
or family_loss_hessian and (paper or pre-everything-heads2 or rmsnorm-affine) \
or run_on_the_gpu_engine and (paper or pre-everything-heads2 or lm-next_token))}"
BUILD=skipped TESTS=skipped BENCH=skipped REST=skipped SAN_memcheck=skipped SAN_racecheck=skipped TESTLINE="" RESTLINE=""

banner "environment"
date -u
uname -a
nvidia-smi || echo "nvidia-smi failed"
command -v nvcc && nvcc --version | tail -2
command -v compute-sanitizer && compute-sanitizer --version | tail -1
"$PY" --version
"$PY" -m pip --version
"$PY" - <<'EOF'
import importlib
for name in ("numpy", "cupy", "torch", "scikit_build_core", "pybind11", "pytest", "cmeel"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:18s} {getattr(mod, '__version__', '?')}")
    except Exception as err:  # noqa: BLE001
        print(f"{name:18s} missing ({type(err).__name__})")
try:
    import torch
    print("torch cuda:", torch.cuda.is_available(), torch.version.cuda)
except Exception:
    pass
EOF
command -v cmake && cmake --version | head -1
command -v ninja && ninja --version

banner "build and install (BLOCKHESS_CUDA=ON)"
# One CPU level (the baseline) is enough to check the GPU against: the AVX2/AVX-512 builds would only
# lengthen the build on a machine whose time is counted.
CMAKE_ARGS=(-Ccmake.define.BLOCKHESS_CUDA=ON -Ccmake.define.BLOCKHESS_CPU_DISPATCH=OFF)
# Eigen: prefer the carried cmeel-eigen wheel, unpacked (a wheel is a zip) into a scratch folder.
EIGEN_WHEEL="$(ls "$ROOT"/benchmarks/wheels/cmeel_eigen-*.whl 2>/dev/null | head -1)"
if [ -n "$EIGEN_WHEEL" ]; then
  EIGEN_PREFIX="$(mktemp -d)/eigen"
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$EIGEN_WHEEL" "$EIGEN_PREFIX"
  EIGEN_DIR="$EIGEN_PREFIX/cmeel.prefix/share/eigen3/cmake"
  if [ -f "$EIGEN_DIR/Eigen3Config.cmake" ]; then
    echo "Eigen from $(basename "$EIGEN_WHEEL") -> $EIGEN_DIR"
    CMAKE_ARGS+=("-Ccmake.define.Eigen3_DIR=$EIGEN_DIR")
  else
    echo "warning: $EIGEN_WHEEL has no share/eigen3/cmake/Eigen3Config.cmake; relying on an installed Eigen"
  fi
else
  echo "no Eigen wheel in benchmarks/wheels/ (prepare it with benchmarks/prepare_gpu_wheels.sh and carry that"
  echo "ignored folder to this machine); relying on an installed cmeel-eigen or a system Eigen 3.4"
fi
# Build for this GPU only (faster than the portable default).
CC_GPU="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
if [ -n "$CC_GPU" ]; then
  CMAKE_ARGS+=("-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$CC_GPU")
  echo "CUDA architecture: sm_$CC_GPU"
fi
# A fresh configure: a build folder from another toolchain must not leak cached results.
CMAKE_ARGS+=(-Ccmake.define.CMAKE_BUILD_TYPE=Release -Cbuild-dir=build/gpu-check)
rm -rf build/gpu-check
T=$(stage_limit 300 150)
echo "time limit ${T}s"
if timeout "$T" "$PY" -m pip install --no-build-isolation --no-deps -v "${CMAKE_ARGS[@]}" . >"$OUT/build.txt" 2>&1; then
  BUILD=ok
elif grep -q -i "permission denied\|not writeable\|externally-managed" "$OUT/build.txt" &&
  timeout "$(stage_limit 240 120)" "$PY" -m pip install --user --no-build-isolation --no-deps -v "${CMAKE_ARGS[@]}" . \
    >>"$OUT/build.txt" 2>&1; then
  BUILD="ok (--user)"
else
  BUILD="FAILED (exit $?)"
fi
grep -E "blockhess: CUDA|CUDA architectures|Eigen|error|Error|Successfully installed" "$OUT/build.txt" | head -40
tail -5 "$OUT/build.txt"
echo "build: $BUILD (full output: build.txt)"

banner "installed package"
(cd /tmp && "$PY" - <<'EOF'
import blockhess
from blockhess import _backend
print("blockhess", blockhess.__version__, "from", blockhess.__file__)
print("_cuda module:", _backend._cuda)
if _backend._cuda is not None:
    print("device_count:", _backend._cuda.device_count())
print("cuda_available:", blockhess.cuda_available())
EOF
) || echo "import failed"
for so in $("$PY" -c "import blockhess, pathlib; print(' '.join(str(p) for p in pathlib.Path(blockhess.__file__).parent.glob('_cuda*.so')))" 2>/dev/null); do
  echo "ldd $so:"
  ldd "$so" | sed 's/^/  /'
done

if [[ "$BUILD" == ok* ]]; then
  banner "GPU tests: pytest -m cuda"
  T=$(stage_limit 180 100)
  echo "time limit ${T}s"
  # Synchronous launches: a kernel fault is reported by the launch that caused it (tests only).
  CUDA_LAUNCH_BLOCKING=1 timeout "$T" "$PY" -m pytest -m cuda -q -rfEs -W default -p no:cacheprovider \
    --junitxml="$OUT/pytest-cuda.xml" tests/test_cuda.py 2>&1 | tee "$OUT/pytest-cuda.txt"
  rc=${PIPESTATUS[0]}
  TESTLINE="$(grep -E " in [0-9.]+s" "$OUT/pytest-cuda.txt" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')"
  case $rc in
    0) TESTS=ok ;;
    124) TESTS="TIMEOUT after ${T}s" ;;
    *) TESTS="FAILED (exit $rc)" ;;
  esac
  if [ "$TESTS" = ok ] && ! grep -q "passed" <<<"$TESTLINE"; then
    TESTS="NOT RUN: every GPU test skipped (no usable GPU / CuPy / CUDA build in this process)"
  fi
  echo "GPU tests: $TESTS $TESTLINE"

  banner "GPU benchmark"
  T=$(stage_limit 200 40)
  echo "time limit ${T}s"
  timeout "$T" "$PY" benchmarks/gpu_bench.py --out "$OUT/bench"
  rc=$?
  case $rc in
    0) BENCH=ok ;;
    124) BENCH="TIMEOUT after ${T}s" ;;
    *) BENCH="exit $rc" ;;
  esac

  # compute-sanitizer over the GPU tests: memcheck (out-of-bounds and misaligned accesses, leaks of
  # device memory the kernels own) and racecheck (shared-memory hazards). Slow under the tool (the
  # whole file takes over 150 s of memcheck), so it runs one test of each kernel family and the
  # engine's assembly on three blocks of the family (SANITIZE_TESTS overrides the selection); each
  # tool gets what time is left, and the summary says how far each got.
  if command -v compute-sanitizer >/dev/null && [ "$(left)" -gt 60 ]; then
    for tool in memcheck racecheck; do
      banner "compute-sanitizer --tool $tool over the GPU tests"
      T=$(stage_limit 150 30)
      echo "time limit ${T}s"
      timeout "$T" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 86 \
        "$PY" -m pytest -m cuda -q -x -p no:cacheprovider tests/test_cuda.py -k "$SANITIZE_TESTS" \
        >"$OUT/sanitizer-$tool.txt" 2>&1
      rc=$?
      tail -8 "$OUT/sanitizer-$tool.txt"
      line="$(grep -E "ERROR SUMMARY|========= [0-9]+ (errors|hazards)|RACECHECK SUMMARY" "$OUT/sanitizer-$tool.txt" | tail -1)"
      case $rc in
        0) res="clean ${line}" ;;
        86) res="ERRORS ${line}" ;;
        124) res="TIMEOUT after ${T}s (partial: ${line:-no summary})" ;;
        *) res="exit $rc ${line}" ;;
      esac
      eval "SAN_${tool}=\"\$res\""
      echo "$tool: $res"
      [ "$(left)" -gt 60 ] || break
    done
  fi

  if [ "$(left)" -gt 45 ]; then
    banner "rest of the test suite (informational; torch here may differ from the pinned test version)"
    T=$(stage_limit 200 10)
    timeout "$T" "$PY" -m pytest -q -m "not cuda and not slow" -x -W default -p no:cacheprovider 2>&1 | tail -15 |
      tee "$OUT/pytest-rest.txt"
    rc=${PIPESTATUS[0]}
    RESTLINE="$(grep -E " in [0-9.]+s" "$OUT/pytest-rest.txt" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')"
    case $rc in 0) REST=ok ;; 124) REST="TIMEOUT" ;; *) REST="exit $rc" ;; esac
  fi
fi

banner "summary"
{
  echo "# blockhess GPU check"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(($(date +%s) - START)) s"
  echo
  echo "| stage | result |"
  echo "|---|---|"
  echo "| build + install (BLOCKHESS_CUDA=ON) | $BUILD |"
  echo "| GPU tests (pytest -m cuda) | $TESTS ${TESTLINE:+($TESTLINE)} |"
  echo "| GPU benchmark | $BENCH |"
  echo "| compute-sanitizer memcheck | $SAN_memcheck |"
  echo "| compute-sanitizer racecheck | $SAN_racecheck |"
  echo "| rest of the suite | $REST ${RESTLINE:+($RESTLINE)} |"
  echo
  if [ -f "$OUT/pytest-cuda.txt" ] && grep -q -E "^(FAILED|ERROR)" "$OUT/pytest-cuda.txt"; then
    echo "## Failing GPU tests"
    echo
    echo '```'
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-cuda.txt" | head -40
    echo '```'
    echo
  fi
  if [ -f "$OUT/bench/results.md" ]; then
    sed 's/^# /## /' "$OUT/bench/results.md"
  fi
} >"$OUT/results.md"
cat "$OUT/results.md"
[[ "$BUILD" == ok* && "$TESTS" == ok ]]
