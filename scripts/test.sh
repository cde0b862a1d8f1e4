#!/usr/bin/env bash
# The test command: installs what is missing, configures, builds and runs ctest (every C++,
# Python-client, reference and monitoring test; not the vLLM, kvpress, GPU or fuzz suites,
# which CONTRIBUTING.md lists with their own commands).
#
#   scripts/test.sh                      # build/ with CUDA when nvcc is present
#   BUILD_DIR=build-asan LAPROX_CMAKE_ARGS="-DLAPROX_SANITIZE=ON" scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh --dev
build_dir=${BUILD_DIR:-build}
jobs=$(nproc)
# shellcheck disable=SC2086  # LAPROX_CMAKE_ARGS is a list of flags
cmake -S . -B "$build_dir" -G Ninja ${LAPROX_CMAKE_ARGS:-}
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$jobs"
