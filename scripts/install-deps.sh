#!/usr/bin/env bash
# Installs the Debian 12 packages laprox needs, by what they are for:
#
#   scripts/install-deps.sh --run     # build and run laproxd and laprox-cli (scripts/demo.sh,
#                                     # scripts/build-release.sh, the images' build stage)
#   scripts/install-deps.sh --dev     # --run, and what the tests, lint and benchmarks need
#                                     # (scripts/test.sh); the default without arguments
#   scripts/install-deps.sh --image   # what deploy/oci/build-cpu-image.sh adds: mmdebstrap, umoci
#
# Idempotent: when every package is already installed it only runs `dpkg-query`
# and exits (well under a second). Needs root (or sudo) only when something is
# missing. Nothing is downloaded from anywhere but the Debian archive.
set -euo pipefail

run=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libabsl-dev nlohmann-json3-dev
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev libmicrohttpd-dev
)
dev=(
  clang-format clang-tidy
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-grpcio python3-protobuf python3-yaml python3-venv
  python3-prometheus-client  # tests/python/test_vllm_metrics.py: the plugin's collector
  prometheus curl systemd
  openssl  # tests/python/test_tls.py makes its CA and certificates with it
)
image=(mmdebstrap umoci)

packages=()
(($# > 0)) || set -- --dev
for arg in "$@"; do
  case "$arg" in
    --run) packages+=("${run[@]}") ;;
    --dev) packages+=("${run[@]}" "${dev[@]}") ;;
    --image) packages+=("${image[@]}") ;;
    *)
      echo "usage: $0 [--run] [--dev] [--image]" >&2
      exit 2
      ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if ((EUID != 0)); then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
