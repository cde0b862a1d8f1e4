#!/usr/bin/env bash
# Cross-check laprox's baseline policies against NVIDIA kvpress itself (not part of CI).
#
#   tests/crosscheck/kvpress/run.sh [--cli=PATH --laproxd=PATH] [crosscheck.py options...]
#
# 1. creates build/kvpress-venv from PyPI with pinned versions (reused when the stamp matches);
# 2. builds laproxd and laprox-cli in build/ unless --cli/--laproxd (or $LAPROX_CLI/$LAPROXD) name
#    existing binaries;
# 3. starts laproxd on a private Unix socket (CPU backend, no metrics port);
# 4. runs crosscheck.py in the venv: a random bf16 Llama model, every kvpress press at several
#    compression ratios and prompt lengths, one safetensors dump per prompt, laprox-cli plan
#    --policy=... --numeric_mode=kvpress_compat --json on it, and the comparison table.
# Outputs (dumps, kvpress kept sets, results.json) go to build/kvpress-crosscheck/.
# Exit status: 0 agree, 1 some head differs or laprox failed, 2 laprox-cli has no --policy yet
# (kvpress side and LAPROX-policy sanity only), 3 as 2 and the LAPROX-policy sanity failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
venv="${KVPRESS_VENV:-$build/kvpress-venv}"
out="${KVPRESS_OUT:-$build/kvpress-crosscheck}"
cli="${LAPROX_CLI:-}"
laproxd="${LAPROXD:-}"

passthrough=()
for arg in "$@"; do
  case "$arg" in
    --cli=*) cli="${arg#--cli=}" ;;
    --laproxd=*) laproxd="${arg#--laproxd=}" ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) passthrough+=("$arg") ;;
  esac
done

source "$root/scripts/lib/venv.sh"
ensure_torch_venv "$venv" .laprox-crosscheck-stamp "torch, kvpress" "$here/requirements.txt"

if [[ -z "$cli" || -z "$laproxd" ]]; then
  echo "== building laproxd and laprox-cli in $build"
  if [[ ! -f "$build/build.ninja" ]]; then
    cmake -S "$root" -B "$build" -G Ninja
  fi
  ninja -C "$build" laproxd laprox-cli
  if [[ -z "$cli" ]]; then
    for c in "$build/client/laprox-cli" "$build/client/cli/laprox-cli"; do
      [[ -x "$c" ]] && cli="$c" && break
    done
  fi
  laproxd="${laproxd:-$build/service/laproxd}"
fi

source "$root/scripts/lib/laproxd.sh"
start_laproxd "$laproxd" "$(mktemp -d "${TMPDIR:-/tmp}/laprox-kvpress.XXXXXX")"
trap stop_laproxd EXIT

set +e
"$venv/bin/python" "$here/crosscheck.py" --cli="$cli" --target="unix:$socket" --out="$out" \
  ${passthrough[@]+"${passthrough[@]}"}
rc=$?
set -e
echo "== crosscheck exit $rc (results: $out/results.json)"
exit $rc
