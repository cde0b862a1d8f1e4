#!/usr/bin/env bash
# End-to-end with the real binaries: laproxd starts on a temporary Unix socket (mode 0660);
# laprox-cli talks to it (info; demo --save; plan of the saved safetensors dump under LAPROX and
# three baselines, whose kept sets must equal the library computing in-process on the same
# file; policy flags of every type change the plan the same way both ways, bad values are
# refused naming the flag); flags from LAPROXD_* environment variables; /metrics counts the calls and the health
# port answers; SIGTERM stops laproxd cleanly (exit 0, socket removed). Usage: laproxd_e2e_test.sh PATH/TO/laproxd PATH/TO/laprox-cli
set -euo pipefail
laproxd=$1
cli=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/laproxd-e2e.XXXXXX")
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
socket=$dir/laproxd.sock

# Ports from the environment (port 0: any free one), the socket from the command line.
LAPROXD_METRICS_LISTEN=127.0.0.1:0 LAPROXD_HEALTH_LISTEN=127.0.0.1:0 LAPROXD_SOCKET=/nonexistent \
  "$laproxd" --socket="$socket" --backend=cpu >"$dir/log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do  # bounded wait for the listening line (at most ~20 s)
  grep -q "listening on" "$dir/log" && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/log"; echo "FAIL: laproxd exited early"; exit 1; }
  sleep 0.1
done
grep -q "listening on unix:$socket" "$dir/log" || { cat "$dir/log"; echo "FAIL: not listening"; exit 1; }
grep -qF "LAPROX_VLLM_TARGET=unix:$socket" "$dir/log" ||
  { cat "$dir/log"; echo "FAIL: no line on how clients reach it"; exit 1; }
mode=$(stat -c '%a' "$socket")
[[ "$mode" == 660 ]] || { echo "FAIL: socket mode $mode, expected 660"; exit 1; }

target=unix:$socket
"$cli" info --target="$target" | grep -q "laproxd 0.1.0" || { echo "FAIL: info"; exit 1; }
"$cli" demo --target="$target" --save="$dir/demo.safetensors" | tee "$dir/table"
grep -q "budget share" "$dir/table" || { echo "FAIL: demo table"; exit 1; }
# The demo's last lines: what the plan kept (the demo's default budget, 128 per head, over its
# 8 layers x 3 KV heads of 2,048 tokens) and where to go next.
grep -q "^kept 3072 of 49152 (layer, KV head, token) entries (6.2%)" "$dir/table" ||
  { echo "FAIL: demo summary line"; exit 1; }
grep -q "^next: .*docs/integrations/hf.md" "$dir/table" || { echo "FAIL: demo next line"; exit 1; }
"$cli" plan "$dir/demo.safetensors" --target="$target" --json --budget=200 >"$dir/remote.json"
"$cli" plan "$dir/demo.safetensors" --local --json --budget=200 >"$dir/local.json"
cmp "$dir/remote.json" "$dir/local.json" || { echo "FAIL: laproxd plan != library plan"; exit 1; }
grep -q '"kept":\[\[\[0,' "$dir/remote.json" || { echo "FAIL: unexpected JSON"; exit 1; }
# The LAPROX defaults spelled out (MEAN_HEAD_PRODUCT, AVG_PEAK pool 31 of the score, window 32)
# plan what no flags plan.
"$cli" plan "$dir/demo.safetensors" --target="$target" --json --budget=200 \
  --gqa_value=mean_head_product --pooling=avg_peak --pool_kernel=31 --pool_target=score \
  --window=32 \
  >"$dir/spelled.json"
cmp "$dir/spelled.json" "$dir/local.json" || { echo "FAIL: not the default policy"; exit 1; }
# A baseline with options left at the policy's defaults (window 64, pool 5), the same both ways.
for policy in streaming_llm critical_adakv cake; do
  flags=(--json --compression_ratio=0.75 --policy="$policy" --numeric_mode=kvpress_compat)
  "$cli" plan "$dir/demo.safetensors" --target="$target" "${flags[@]}" >"$dir/remote.json"
  "$cli" plan "$dir/demo.safetensors" --local "${flags[@]}" >"$dir/local.json"
  cmp "$dir/remote.json" "$dir/local.json" || { echo "FAIL: $policy plan differs"; exit 1; }
done

# Every kind of policy flag reaches laproxd: with FLAG added to BASE the plan changes, and
# laproxd plans what the library plans in-process.
remote_plans=0
check_flag() {  # BASE FLAG (BASE: flags separated by spaces)
  local -a base
  read -r -a base <<<"$1"
  local args=(plan "$dir/demo.safetensors" --json --budget=200 "${base[@]}")
  "$cli" "${args[@]}" "$2" --target="$target" >"$dir/remote.json"
  "$cli" "${args[@]}" "$2" --local >"$dir/local.json"
  "$cli" "${args[@]}" --local >"$dir/without.json"
  remote_plans=$((remote_plans + 1))
  cmp "$dir/remote.json" "$dir/local.json" || { echo "FAIL: $1 $2: laproxd != library"; exit 1; }
  if cmp -s "$dir/remote.json" "$dir/without.json"; then echo "FAIL: $2 has no effect"; exit 1; fi
}
check_flag "" --gqa_value=mean_head_norm  # an enum (the default before bench/quality's grid)
check_flag "" --pool_target=attention  # the default pools the score
check_flag "" --gqa_value=exact_block  # an enum that needs cross-Grams
check_flag "" --preset=paper
check_flag "" --min_per_head=150  # an integer
check_flag "--kind=pyramidkv --compression_ratio=0.75" --pyramid_beta=2  # a double
check_flag "" --head_uniform_layers  # the bool
# A bad value names the flag and the accepted values; a preset needs kind LAPROX.
expect_error() {  # MESSAGE FLAG...
  local message=$1
  shift
  if "$cli" plan "$dir/demo.safetensors" --local "$@" 2>"$dir/err"; then
    echo "FAIL: $* accepted"; exit 1
  fi
  grep -qF -- "$message" "$dir/err" || { cat "$dir/err"; echo "FAIL: $* message"; exit 1; }
}
expect_error "--gqa_value=exact is not one of mean_head_norm, summed_projection, \
mean_head_product, exact_block" --gqa_value=exact
expect_error "--pool_target=both is not one of attention, score" --pool_target=both
expect_error "policy.preset = POLICY_PRESET_PAPER needs policy.kind = POLICY_KIND_LAPROX" \
  --preset=paper --kind=snapkv
expect_error "'pyramid_beta'" --pyramid_beta=steep

metrics_port=$(grep -o 'metrics on http port [0-9]*' "$dir/log" | awk '{print $NF}')
health_port=$(grep -o 'health on tcp port [0-9]*' "$dir/log" | awk '{print $NF}')
[[ -n "$metrics_port" && -n "$health_port" ]] || { echo "FAIL: LAPROXD_*_LISTEN ignored"; exit 1; }
curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$dir/metrics"
# Remote plans: demo, two LAPROX plans, one per baseline, one per checked flag (the --local ones
# never reach laproxd).
grep -qx "laprox_requests_total{code=\"OK\",method=\"ComputeKeepMask\"} $((6 + remote_plans))" \
  "$dir/metrics" ||
  { grep ComputeKeepMask "$dir/metrics"; echo "FAIL: metrics"; exit 1; }
"$cli" health --target="127.0.0.1:$health_port" || { echo "FAIL: liveness"; exit 1; }
if "$cli" health --target="127.0.0.1:$health_port" --service=laprox.v1.Laprox; then
  echo "FAIL: ready without a registered model"; exit 1
fi

kill -TERM "$pid"
status=0
wait "$pid" || status=$?
cat "$dir/log"
[[ $status -eq 0 ]] || { echo "FAIL: exit status $status after SIGTERM"; exit 1; }
grep -q "laproxd: stopped" "$dir/log" || { echo "FAIL: no clean stop"; exit 1; }
[[ ! -e "$socket" ]] || { echo "FAIL: socket left behind"; exit 1; }
echo "1 passed, 0 failed"
