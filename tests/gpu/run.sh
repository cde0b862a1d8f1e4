#!/usr/bin/env bash
# The GPU checks of the CUDA backend in one go, on a machine with an NVIDIA GPU (docs/design.md
# §7). Writes full logs to LOGDIR and prints a short summary table last.
#
#   tests/gpu/run.sh LOGDIR                 build here with CUDA (build-gpu/, needs the build
#                                           dependencies of scripts/install-deps.sh), then run
#   tests/gpu/run.sh --pack DIR             on a build machine without a GPU: build build-gpu/
#                                           and pack the binaries with the Debian libraries they
#                                           need (not cuBLAS: the GPU machine's CUDA 13 has it)
#                                           into DIR/laprox-gpu.tar.xz
#   tests/gpu/run.sh --packed DIR LOGDIR    on a GPU machine without those dependencies: unpack
#                                           DIR/laprox-gpu.tar.xz and run it
#
# What runs (must finish in under 8 minutes on one H200):
#   1. nvidia-smi; the CUDA tests: CUDA-vs-CPU keep-plans over the grid (both kernel versions,
#      host and device inputs), device selection vs the host selection, the CUDA IPC test (a
#      separate exporter process, bad cuda_ipc regions);
#   2. compute-sanitizer --tool memcheck over the CUDA tests (small cases), and racecheck over
#      the kernels that use shared memory;
#   3. bench/kernels_cuda_benchmark (Llama-3.1-8B geometry, bf16, w 32/64, n 4K/32K/128K, the
#      gemm and fused kernels, with the copy-bandwidth / GEMM-rate floor) and bench/cuda_reference.py (PyTorch,
#      V.W_O per head) when python3 has torch with CUDA.
# Exit status: 0 when every test and sanitizer run passed (the benchmark never fails it).
set -uo pipefail
run_env=()  # prefix of every command that runs a laprox binary (--packed: its libraries)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$root/build-gpu"
targets=(laprox_cuda_backend_test laprox_cuda_select_test laprox_cuda_ipc_test
         laprox_cuda_ipc_exporter kernels_cuda_benchmark laproxd)

build_gpu() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLAPROX_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null || return 1
  local present=()
  for t in "${targets[@]}"; do
    if ninja -C "$build" -t query "$t" >/dev/null 2>&1; then present+=("$t"); fi
  done
  cmake --build "$build" -j "$(nproc)" --target "${present[@]}"
}

# Binaries (by path relative to the build) and scripts the run needs.
collect() {  # prints paths relative to $build
  for t in tests/cuda/laprox_cuda_backend_test tests/cuda/laprox_cuda_select_test \
           tests/cuda/laprox_cuda_ipc_test tests/cuda/laprox_cuda_ipc_exporter \
           bench/kernels_cuda_benchmark service/laproxd; do
    [[ -x "$build/$t" ]] && echo "$t"
  done
}

if [[ "${1:-}" == "--pack" ]]; then
  out="${2:?usage: tests/gpu/run.sh --pack DIR}"
  build_gpu || exit 1
  stage="$(mktemp -d)"
  mkdir -p "$stage/bin" "$stage/lib"
  mapfile -t bins < <(collect)
  for b in "${bins[@]}"; do cp "$build/$b" "$stage/bin/"; done
  cp "$root/bench/cuda_reference.py" "$stage/bin/"
  # Shared libraries outside the C runtime and outside cuBLAS (present wherever CUDA 13 is).
  # Never the driver (libcuda, libnvidia-*): the build machine has at most a stub of it, which
  # first on LD_LIBRARY_PATH would hide the GPU machine's real driver.
  for b in "${bins[@]}"; do ldd "$build/$b"; done | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libdl|librt|libpthread|libgcc_s|ld-linux[^/]*|libcublas|libcublasLt|libcuda|libnvidia-[^/]*)\.so' |
    while read -r lib; do cp -L "$lib" "$stage/lib/"; done
  mkdir -p "$out"
  tar -C "$stage" -cJf "$out/laprox-gpu.tar.xz" bin lib
  rm -rf "$stage"
  echo "packed $(du -h "$out/laprox-gpu.tar.xz" | cut -f1) into $out/laprox-gpu.tar.xz"
  exit 0
fi

if [[ "${1:-}" == "--packed" ]]; then
  packed="${2:?usage: tests/gpu/run.sh --packed DIR LOGDIR}"
  logs="${3:?usage: tests/gpu/run.sh --packed DIR LOGDIR}"
  bin="$(mktemp -d)"
  tar -C "$bin" -xJf "$packed/laprox-gpu.tar.xz" || exit 1
  cuda_libs=$(find / -xdev -name 'libcublasLt.so.13*' -printf '%h\n' 2>/dev/null | head -1)
  # The packed libraries only for our binaries (and the exporter they start), not exported:
  # python3 (the summary, torch) and nvidia-smi must keep the GPU machine's own libraries.
  run_env=(env "LD_LIBRARY_PATH=$bin/lib:${cuda_libs:+$cuda_libs:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  test_bin="$bin/bin"; bench_bin="$bin/bin"; reference="$bin/bin/cuda_reference.py"
else
  logs="${1:?usage: tests/gpu/run.sh LOGDIR}"
  build_gpu > /tmp/laprox-gpu-build.log 2>&1 || { tail -30 /tmp/laprox-gpu-build.log; exit 1; }
  test_bin="$build/tests/cuda"; bench_bin="$build/bench"; reference="$root/bench/cuda_reference.py"
fi
mkdir -p "$logs"
start=$(date +%s)
# Every step runs under `timeout` with the smaller of its own cap and what is left of the
# 7.5-minute budget, so the whole script ends in under 8 minutes even when a step hangs.
budget=450
cap() {  # cap SECONDS -> seconds this step may take (at least 1)
  local left=$(( budget - ($(date +%s) - start) ))
  (( left < 1 )) && left=1
  echo $(( $1 < left ? $1 : left ))
}
declare -A result
status=0

nvidia-smi -L > "$logs/nvidia-smi.txt" 2>&1 || true
nvidia-smi >> "$logs/nvidia-smi.txt" 2>&1 || true

# gtest binary -> "passed/total, skipped" from its XML report.
gtest_counts() {
  python3 - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    r = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"no report ({e.__class__.__name__})"); sys.exit()
tests = int(r.get("tests", 0)); fail = int(r.get("failures", 0)) + int(r.get("errors", 0))
skip = sum(1 for c in r.iter("testcase") if c.find("skipped") is not None)
print(f"{tests - fail - skip}/{tests} passed, {skip} skipped, {fail} failed")
EOF
}

run_test() {  # name binary [args...]
  local name=$1 binary=$2; shift 2
  if [[ ! -x "$binary" ]]; then result[$name]="not built"; return; fi
  timeout "$(cap 120)" ${run_env[@]+"${run_env[@]}"} "$binary" --gtest_output="xml:$logs/$name.xml" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  result[$name]="$(gtest_counts "$logs/$name.xml") (exit $rc)"
  [[ $rc -ne 0 ]] && status=1
}

echo "== CUDA tests"
export LAPROX_IPC_EXPORTER="$test_bin/laprox_cuda_ipc_exporter"
run_test backend "$test_bin/laprox_cuda_backend_test"
run_test select "$test_bin/laprox_cuda_select_test"
run_test ipc "$test_bin/laprox_cuda_ipc_test"

echo "== compute-sanitizer"
sanitize() {  # name seconds tool binary [args...]
  local name=$1 seconds=$2 tool=$3 binary=$4; shift 4
  if ! command -v compute-sanitizer >/dev/null; then result[$name]="no compute-sanitizer"; return; fi
  if [[ ! -x "$binary" ]]; then result[$name]="not built"; return; fi
  LAPROX_CUDA_TEST_SMALL=1 timeout "$(cap "$seconds")" ${run_env[@]+"${run_env[@]}"} compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$binary" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  result[$name]="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$name.log" | tail -1) (exit $rc$( (( rc == 124 )) && echo ', timed out'))"
  [[ $rc -ne 0 ]] && status=1
}
sanitize memcheck-backend 120 memcheck "$test_bin/laprox_cuda_backend_test"
sanitize memcheck-select 60 memcheck "$test_bin/laprox_cuda_select_test"
sanitize racecheck-backend 90 racecheck "$test_bin/laprox_cuda_backend_test" \
  --gtest_filter='*MatchesCpuWithDeviceInputs*'
sanitize racecheck-select 60 racecheck "$test_bin/laprox_cuda_select_test" \
  --gtest_filter='*EdgeShapes*:*IsDeterministic*'
sanitize memcheck-ipc 60 memcheck "$test_bin/laprox_cuda_ipc_test"

echo "== benchmark"
if [[ -x "$bench_bin/kernels_cuda_benchmark" ]]; then
  timeout "$(cap 150)" ${run_env[@]+"${run_env[@]}"} "$bench_bin/kernels_cuda_benchmark" --json="$logs/bench.json" \
    > "$logs/bench.log" 2>&1 || echo "benchmark failed (see bench.log)" >> "$logs/bench.log"
fi
timeout "$(cap 100)" python3 "$reference" --json="$logs/reference.json" > "$logs/reference.log" 2>&1 ||
  echo "reference failed (see reference.log)" >> "$logs/reference.log"

{
  echo "# tests/gpu/run.sh summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - start )) s)"
  echo
  echo "GPU: $(head -1 "$logs/nvidia-smi.txt")"
  echo
  echo "A timed-out step (exit 124) counts as failed; its log shows how far it got."
  echo
  echo "| check | result |"
  echo "|---|---|"
  for k in backend select ipc memcheck-backend memcheck-select racecheck-backend racecheck-select \
           memcheck-ipc; do
    echo "| $k | ${result[$k]:-not run} |"
  done
  echo
  python3 - "$logs" <<'EOF'
import json, os, sys
logs = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(logs, name)) as f:
            return json.load(f)
    except Exception:
        return None
bench, ref = load("bench.json"), load("reference.json")
if not bench:
    print("benchmark: no results (see bench.log)"); sys.exit()
print(f"Floor: copy bandwidth {bench['copy_bandwidth_Bps']/1e9:.0f} GB/s, bf16 GEMM "
      f"{bench['bf16_gemm_flops']/1e12:.0f} TFLOP/s; ours = median of {bench['iters']}")
print()
refs = {(r["n"], r["w"]): r["median_ms"] for r in (ref or {}).get("rows", [])}
print("| n | w | kernels | ours ms | floor ms | x floor | torch V.W_O ms | torch / ours |")
print("|---|---|---|---|---|---|---|---|")
for r in bench["rows"]:
    t = refs.get((r["n"], r["w"]))
    print(f"| {r['n']} | {r['w']} | {r['kernels']} | {r['median_ms']:.3f} | "
          f"{r['floor_ms']:.3f} | {r['median_ms']/r['floor_ms']:.2f} | "
          f"{'%.1f' % t if t else '-'} | {'%.1f' % (t / r['median_ms']) if t else '-'} |")
EOF
} | tee "$logs/summary.md"
exit $status
