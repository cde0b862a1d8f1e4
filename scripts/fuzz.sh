#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (LAPROX_FUZZ=ON: clang 14, ASan + UBSan, CPU backend
# only) in build-fuzz/ and runs each one for SECONDS_PER_TARGET seconds (default 60) on a copy of
# its seed corpus. Fails on any finding (crash, sanitizer report, leak, timeout, an allocation
# or RSS past FUZZ_MEMORY_MB), printing the report and the file that reproduces it. Prints the
# executions per target and in total.
#
#   scripts/fuzz.sh                                # 60 s per target (.ci/run)
#   scripts/fuzz.sh 600                            # longer
#   FUZZ_TARGETS="parsers register_region" scripts/fuzz.sh 30
#   FUZZ_ARGS="-jobs=2 -workers=2" scripts/fuzz.sh 3600   # extra libFuzzer flags
#
# Installs clang-14 and libclang-rt-14-dev when they are missing (and what scripts/install-deps.sh
# installs). tests/fuzz/README.md: running one target longer, reproducing a crash, adding one.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]" >&2
  exit 2
fi
build_dir=$(realpath -m "${BUILD_DIR:-build-fuzz}")
targets=${FUZZ_TARGETS:-compute_keep_mask compute_keep_plans register_model register_region parsers}
memory_mb=${FUZZ_MEMORY_MB:-2048}
unit_timeout=${FUZZ_UNIT_TIMEOUT:-30}  # seconds one input may take before it is a finding

scripts/install-deps.sh
fuzz_packages=(clang-14 libclang-rt-14-dev)
missing=()
for p in "${fuzz_packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "fuzz: installing ${missing[*]}"
  sudo_cmd=()
  if ((EUID != 0)); then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

started=$(date +%s)
cmake -S . -B "$build_dir" -G Ninja -DLAPROX_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++-14 \
  -DLAPROX_CUDA=OFF -DLAPROX_BUILD_BENCH=OFF -DLAPROX_BUILD_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target laprox_fuzz
echo "fuzz: built $build_dir in $(($(date +%s) - started)) s"

run_dir="$build_dir/fuzz-run"
rm -rf "$run_dir"
mkdir -p "$run_dir"
# Fresh seeds from the generator, beside the committed ones (tests/fuzz/corpus), so seeds follow
# the proto even before the committed files are regenerated.
"$build_dir/tests/fuzz/make_seeds" "$run_dir/seeds" >/dev/null

# A harness that dies leaves its shm objects (laprox-fuzz-<pid>...); remove those whose process
# is gone.
remove_stale_objects() {
  local f pid
  for f in /dev/shm/laprox-fuzz-*; do
    [[ -e "$f" ]] || continue
    pid=${f#/dev/shm/laprox-fuzz-}
    pid=${pid%%-*}
    [[ "$pid" =~ ^[0-9]+$ && ! -d "/proc/$pid" ]] && rm -f "$f"
  done
  return 0
}

total=0
failed=()
summary=()
for target in $targets; do
  binary="$build_dir/tests/fuzz/${target}_fuzzer"
  work="$run_dir/$target"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp tests/fuzz/corpus/"$target"/* "$work/corpus/"
  cp "$run_dir/seeds/$target"/* "$work/corpus/"
  echo "== fuzz $target: ${seconds} s, $(find "$work/corpus" -type f | wc -l) seeds"
  rc=0
  # In $work: with -jobs, libFuzzer writes fuzz-<job>.log files into the current directory.
  # shellcheck disable=SC2086  # FUZZ_ARGS is a list of flags
  (cd "$work" && timeout --kill-after=30 $((seconds + unit_timeout + 120)) \
    "$binary" -max_total_time="$seconds" -malloc_limit_mb="$memory_mb" \
    -rss_limit_mb="$memory_mb" -timeout="$unit_timeout" -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" ${FUZZ_ARGS:-} corpus) >"$work/log" 2>&1 || rc=$?
  remove_stale_objects
  execs=$(awk '/^stat::number_of_executed_units:/ {n += $2} END {print n + 0}' "$work/log")
  rate=$(awk '/^stat::average_exec_per_sec:/ {r += $2} END {print r + 0}' "$work/log")
  total=$((total + execs))
  mapfile -t findings < <(find "$work/artifacts" -type f \
    \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | sort)
  if ((rc != 0 || ${#findings[@]} > 0)); then
    failed+=("$target")
    summary+=("$(printf '%-20s %12s executions %8s exec/s  FINDING (exit %s)' "$target" "$execs" \
      "$rate" "$rc")")
    echo "fuzz: $target found something (exit $rc); the end of $work/log:"
    grep -v -e '^#[0-9]' -e '^\s*NEW_FUNC' "$work/log" | tail -n 60
    for f in "${findings[@]}"; do
      echo "fuzz: reproduce with: $binary $f"
    done
  else
    summary+=("$(printf '%-20s %12s executions %8s exec/s  ok' "$target" "$execs" "$rate")")
  fi
done

echo "== fuzz summary (${seconds} s per target)"
printf '%s\n' "${summary[@]}"
echo "total: $total executions"
if ((${#failed[@]} > 0)); then
  echo "fuzz: findings in ${failed[*]} (logs and inputs under $run_dir)" >&2
  exit 1
fi
