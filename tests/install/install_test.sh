#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then a separate project finds the package with
# find_package(laprox), builds against laprox::client and laprox::kernels, and runs.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/laprox-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/laproxd"
test -f "$work/prefix/include/laprox/client/client.h"
cmake -S "$source/tests/install/consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer"
echo "1 passed, 0 failed"
