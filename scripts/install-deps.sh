#!/usr/bin/env bash
# Installs the Debian 12 packages laprox builds, tests and benchmarks with.
#
# Idempotent: when every package is already installed it only runs `dpkg-query`
# and exits (well under a second). Needs root (or sudo) only when something is
# missing. Nothing is downloaded from anywhere but the Debian archive.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  clang-format clang-tidy
  libopenblas-dev libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  python3 python3-numpy python3-grpcio python3-protobuf python3-yaml python3-venv
  python3-prometheus-client  # tests/python/test_vllm_metrics.py: the plugin's collector
  prometheus-cpp-dev libmicrohttpd-dev prometheus curl systemd
  openssl  # tests/python/test_tls.py makes its CA and certificates with it
)

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
