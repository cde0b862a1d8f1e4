#!/usr/bin/env bash
# Runs the CPU keep-plan benchmark and the numpy timing on the same inputs, then prints one table.
#
#   bench/run_cpu_bench.sh BUILD_DIR [WORK_DIR]
#
# BUILD_DIR must already contain bench/kernels_cpu_benchmark (configure with
# -DLAPROX_BUILD_BENCH=ON and build it; this script builds nothing). The benchmark writes every
# case's inputs (about 5 GB in all: the Llama o_proj alone is 2.1 GB) to WORK_DIR, default a
# fresh directory under ${TMPDIR:-/tmp} that is removed on exit; bench/numpy_laprox.py reads
# them back, so both sides score identical data. PYTHON (default /usr/bin/python3, Debian's numpy
# on the system OpenBLAS) runs the numpy side. Extra benchmark flags go in BENCH_FLAGS, e.g.
# BENCH_FLAGS='--benchmark_filter=SmolLM2'. Takes about 5 minutes on 2 cores, most of it the
# naive numpy Llama run.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 BUILD_DIR [WORK_DIR]" >&2
  exit 2
fi
build_dir=$1
binary=$build_dir/bench/kernels_cpu_benchmark
if [[ ! -x $binary ]]; then
  echo "$0: $binary not found; configure with -DLAPROX_BUILD_BENCH=ON and build it" >&2
  exit 1
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-/usr/bin/python3}

if [[ $# -eq 2 ]]; then
  work=$2
  mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/laprox-cpu-bench.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi

echo "== machine"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|L3)' || true
echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-<unset>}" \
  "OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS-<unset>}"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "== C++ (kernels_cpu_benchmark)"
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
LAPROX_BENCH_DUMP=$work/inputs "$binary" --benchmark_counters_tabular=true \
  --benchmark_out="$work/cpp.json" --benchmark_out_format=json ${BENCH_FLAGS:-}
echo
echo "== numpy (bench/numpy_laprox.py)"
# The benchmark may have restarted itself with OPENBLAS_CORETYPE (laprox/kernels/openblas_core.h:
# a CPU model this OpenBLAS does not know gets its SSE3 kernels): numpy, on the same library,
# gets the kernels the C++ side ran with.
core=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["context"]["laprox_openblas_core"])' "$work/cpp.json")
echo "OPENBLAS_CORETYPE=$core for numpy (the C++ side's kernels)"
OPENBLAS_CORETYPE=$core "$python" "$here/numpy_laprox.py" --inputs "$work/inputs" --cpp-json "$work/cpp.json" \
  --json "$work/numpy.json"
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
