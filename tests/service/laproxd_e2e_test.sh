#!/usr/bin/env bash
# End-to-end with the real binaries: laproxd starts on a temporary Unix socket (mode 0660);
# laprox-cli talks to it (info; demo --save; plan of the saved safetensors dump under LAPROX and
# three baselines, whose kept sets must equal the library computing in-process on the same
# file); flags from LAPROXD_* environment variables; /metrics counts the calls and the health
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
mode=$(stat -c '%a' "$socket")
[[ "$mode" == 660 ]] || { echo "FAIL: socket mode $mode, expected 660"; exit 1; }

target=unix:$socket
"$cli" info --target="$target" | grep -q "laproxd 0.1.0" || { echo "FAIL: info"; exit 1; }
"$cli" demo --target="$target" --save="$dir/demo.safetensors" | tee "$dir/table"
grep -q "budget share" "$dir/table" || { echo "FAIL: demo table"; exit 1; }
"$cli" plan "$dir/demo.safetensors" --target="$target" --json --budget=200 >"$dir/remote.json"
"$cli" plan "$dir/demo.safetensors" --local --json --budget=200 >"$dir/local.json"
cmp "$dir/remote.json" "$dir/local.json" || { echo "FAIL: laproxd plan != library plan"; exit 1; }
grep -q '"kept":\[\[\[0,' "$dir/remote.json" || { echo "FAIL: unexpected JSON"; exit 1; }
# A baseline with options left at the policy's defaults (window 64, pool 5), the same both ways.
for policy in streaming_llm critical_adakv cake; do
  flags=(--json --compression_ratio=0.75 --policy="$policy" --numeric_mode=kvpress_compat)
  "$cli" plan "$dir/demo.safetensors" --target="$target" "${flags[@]}" >"$dir/remote.json"
  "$cli" plan "$dir/demo.safetensors" --local "${flags[@]}" >"$dir/local.json"
  cmp "$dir/remote.json" "$dir/local.json" || { echo "FAIL: $policy plan differs"; exit 1; }
done

metrics_port=$(grep -o 'metrics on http port [0-9]*' "$dir/log" | awk '{print $NF}')
health_port=$(grep -o 'health on tcp port [0-9]*' "$dir/log" | awk '{print $NF}')
[[ -n "$metrics_port" && -n "$health_port" ]] || { echo "FAIL: LAPROXD_*_LISTEN ignored"; exit 1; }
curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$dir/metrics"
# Remote plans: demo, one LAPROX plan, one per baseline (the --local ones never reach laproxd).
grep -qx 'laprox_requests_total{code="OK",method="ComputeKeepMask"} 5' "$dir/metrics" ||
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
