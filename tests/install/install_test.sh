#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then a separate project finds the package with
# find_package(laprox), builds one program against laprox::client alone and one against
# laprox::kernels, and runs both. The client's program must not be linked with OpenBLAS or any
# CUDA library (a client that depended on the compute library would bring libopenblas, and with
# the CUDA backend built, libcudart and libcublas).
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
"$work/consumer/client_consumer"
"$work/consumer/kernels_consumer"
# What the client's program is linked with (the link command) and needs at run time (its
# dynamic section; the linker drops unused shared libraries, so the command is the stricter
# check).
link=$(ninja -C "$work/consumer" -t commands client_consumer | tail -n 1)
needed=$(readelf -d "$work/consumer/client_consumer" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
forbidden='openblas|blas|lapack|cuda|cublas'
if grep -qE "$forbidden" <<<"$link$needed"; then
  echo "FAIL: client_consumer (laprox::client only) links or needs:" \
    "$(grep -oE "[^ ]*($forbidden)[^ ]*" <<<"$link$needed" | sort -u | tr '\n' ' ')" >&2
  exit 1
fi
# The check can fail: the compute library's own program is linked with OpenBLAS.
ninja -C "$work/consumer" -t commands kernels_consumer | tail -n 1 | grep -q blas || {
  echo "FAIL: kernels_consumer is not linked with OpenBLAS, so the client check proves nothing" >&2
  exit 1
}
echo "client_consumer needs: $(tr '\n' ' ' <<<"$needed")"
echo "1 passed, 0 failed"
