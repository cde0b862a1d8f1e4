#!/usr/bin/env bash
# The release build the container images ship: scripts/test.sh's configure and build steps
# (same generator, same LAPROX_CMAKE_ARGS hook) in Release, without tests or benchmarks, and
# only the two programs an image needs. Used by deploy/docker/Dockerfile.{cpu,cuda}.
#
#   scripts/build-release.sh              # into build-release/, with CUDA when nvcc is found
#   BUILD_DIR=/src/build LAPROX_CMAKE_ARGS="-DLAPROX_CUDA=OFF" scripts/build-release.sh
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh --run
build_dir=${BUILD_DIR:-build-release}
jobs=$(nproc)
# shellcheck disable=SC2086  # LAPROX_CMAKE_ARGS is a list of flags
cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DLAPROX_BUILD_TESTS=OFF -DLAPROX_BUILD_BENCH=OFF \
  ${LAPROX_CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$jobs" --target laproxd laprox-cli
