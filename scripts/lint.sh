#!/usr/bin/env bash
# clang-tidy with the curated .clang-tidy over the project's own sources (needs a configured
# build directory for compile_commands.json; CUDA sources are skipped). By default the library,
# tools and benchmarks; --all adds the gtest files (slow: gmock headers dominate).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
if [[ "${1:-}" == "--all" ]]; then
  mapfile -t files < <(git ls-files '*.cc')
else
  mapfile -t files < <(git ls-files '*.cc' | grep -v '_test\.cc$')
fi
printf "%s\n" "${files[@]}" | xargs -P "$(nproc)" -n 4 clang-tidy -p "$build_dir" --quiet
