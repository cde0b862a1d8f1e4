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
python="${PYTHON:-python3}"
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

# torch from PyPI: the Linux x86_64 wheel is a CUDA build whose libtorch_cpu.so/libtorch_cuda.so
# have DT_NEEDED entries on the CUDA libraries below, so `import torch` fails without them even on a
# CPU-only machine (and system CUDA libraries are not ABI-matched: e.g. a system NCCL lacks
# ncclCommResume). We install torch --no-deps plus exactly the wheels that provide those sonames
# (~2.46 GB download) and skip the rest of torch's default set (triton, cusolver, cuda-bindings,
# cuda-toolkit, cccl, nvtx: ~0.53 GB more, ~3.0 GB in all), which a CPU run never loads.
TORCH_WHEELS=(
  torch==2.15.0
  nvidia-cuda-runtime==13.2.86    # libcudart.so.13
  nvidia-cuda-cupti==13.2.86      # libcupti.so.13
  nvidia-cuda-nvrtc==13.2.86      # libnvrtc.so.13
  nvidia-cublas==13.4.1.3         # libcublas.so.13, libcublasLt.so.13
  nvidia-cufft==12.2.0.57         # libcufft.so.12
  nvidia-cusparse==12.7.10.12     # libcusparse.so.12
  nvidia-nvjitlink==13.5.37       # libnvJitLink.so.13 (needed by cusparse)
  nvidia-cufile==1.17.1.22        # libcufile.so.0
  nvidia-cusparselt-cu13==0.8.1   # libcusparseLt.so.0
  nvidia-nccl-cu13==2.30.7        # libnccl.so.2
  nvidia-cudnn-cu13==9.26.0.51    # libcudnn.so.9
  nvidia-nvshmem-cu13==3.7.2      # libnvshmem_host.so.3
)

stamp_text="$(printf '%s\n' "${TORCH_WHEELS[@]}"; cat "$here/requirements.txt")"
stamp="$venv/.laprox-crosscheck-stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] &&
   "$venv/bin/python" -c "import torch, kvpress" 2>/dev/null; then
  echo "== reusing $venv"
else
  echo "== creating $venv (downloads ~2.5 GB from PyPI)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  start=$(date +%s)
  "$venv/bin/pip" install --no-deps --progress-bar off "${TORCH_WHEELS[@]}"
  "$venv/bin/pip" install --no-deps --progress-bar off -r "$here/requirements.txt"
  "$venv/bin/python" -c "import torch, kvpress; print('torch', torch.__version__, 'ok')"
  echo "== venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
  printf '%s' "$stamp_text" > "$stamp"
fi

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

tmp="$(mktemp -d "${TMPDIR:-/tmp}/laprox-kvpress.XXXXXX")"
socket="$tmp/laproxd.sock"
"$laproxd" --socket="$socket" --metrics_listen= --backend=cpu >"$tmp/laproxd.log" 2>&1 &
laproxd_pid=$!
cleanup() {
  kill "$laproxd_pid" 2>/dev/null || true
  wait "$laproxd_pid" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
for _ in $(seq 100); do
  [[ -S "$socket" ]] && break
  if ! kill -0 "$laproxd_pid" 2>/dev/null; then
    echo "laproxd exited:"; cat "$tmp/laproxd.log"; exit 1
  fi
  sleep 0.1
done
[[ -S "$socket" ]] || { echo "laproxd did not create $socket"; cat "$tmp/laproxd.log"; exit 1; }
echo "== laproxd pid $laproxd_pid on unix:$socket"

set +e
"$venv/bin/python" "$here/crosscheck.py" --cli="$cli" --target="unix:$socket" --out="$out" \
  ${passthrough[@]+"${passthrough[@]}"}
rc=$?
set -e
echo "== crosscheck exit $rc (results: $out/results.json)"
exit $rc
