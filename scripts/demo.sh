#!/usr/bin/env bash
# The main job, end to end on this machine: installs what is missing, builds, starts laproxd on
# the CPU backend on a private Unix socket, runs `laprox-cli demo` against it (a realistic
# sample: attention sinks, heavy hitters, value norms growing with depth) and prints the budget
# share of every (layer, KV head), then stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh --run
build_dir=${BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja ${LAPROX_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target laproxd laprox-cli

run=$(mktemp -d "${TMPDIR:-/tmp}/laprox-demo.XXXXXX")
socket=$run/laproxd.sock
"$build_dir/service/laproxd" --socket="$socket" --backend=cpu --metrics_listen=127.0.0.1:0 \
  >"$run/laproxd.log" 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$run"' EXIT
for _ in $(seq 1 100); do [[ -S "$socket" ]] && break; sleep 0.1; done
cat "$run/laproxd.log"
"$build_dir/client/laprox-cli" info --target="unix:$socket"
"$build_dir/client/laprox-cli" demo --target="unix:$socket" "$@"
