#!/usr/bin/env bash
# Downloads the build-time wheels that benchmarks/gpu_check.sh needs on the offline GPU machine:
#
#     bash benchmarks/prepare_gpu_wheels.sh          # on a machine with network, before the GPU run
#
# The C++ core needs the Eigen 3.4 headers at build time and the GPU machine has neither network nor
# cmeel-eigen, so the cmeel-eigen wheel (and cmeel, to pip install it the usual way if wanted) goes
# into benchmarks/wheels/. That folder is ignored by git: copy it to the GPU machine with the
# checkout. gpu_check.sh unpacks the Eigen wheel from there (a wheel is a zip; nothing is
# installed); without it, it relies on an installed Eigen.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p benchmarks/wheels
"$PY" -m pip download --no-deps --only-binary=:all: -d benchmarks/wheels cmeel-eigen cmeel
ls -l benchmarks/wheels
