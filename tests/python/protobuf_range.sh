#!/usr/bin/env bash
# The laprox Python package on the oldest and the newest grpcio/protobuf it supports, from PyPI
# (not part of ctest: it downloads).
#
#   tests/python/protobuf_range.sh LAPROXD [DIR]
#
# In DIR (default $LAPROX_RANGE_DIR, else /tmp/laprox-protobuf-range) it creates two venvs with
# $PYTHON (default python3):
#   oldest  protobuf 4.21.12 and grpcio 1.51.1 (Debian 12's), grpcio-reflection and
#           grpcio-health-checking 1.51.1;
#   newest  the latest protobuf 7.x and grpcio 1.85.x, grpcio-reflection and
#           grpcio-health-checking (which pin protobuf 7 themselves);
# installs client/python into each with pip (not editable; the build runs in pip's isolated
# environment with the latest grpcio-tools), checks `pip check`, and runs the client tests
# (run_tests.py --installed) against LAPROXD. Extra arguments for unittest go in
# $LAPROX_RANGE_TEST_ARGS (e.g. "-k Runtime"). Exit status 0 when both venvs pass.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  sed -n '2,16p' "$0"
  exit 2
fi
laproxd="$(realpath "$1")"
dir="${2:-${LAPROX_RANGE_DIR:-/tmp/laprox-protobuf-range}}"
python="${PYTHON:-python3}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
read -r -a test_args <<< "${LAPROX_RANGE_TEST_ARGS:-}"

declare -A requirements=(
  [oldest]="protobuf==4.21.12 grpcio==1.51.1 grpcio-reflection==1.51.1
            grpcio-health-checking==1.51.1"
  [newest]="protobuf>=7,<8 grpcio>=1.85,<1.86 grpcio-reflection grpcio-health-checking"
)

status=0
for name in oldest newest; do
  venv="$dir/$name"
  echo "== $name: $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
  # shellcheck disable=SC2086  # the requirements are words
  "${pip[@]}" install --progress-bar off ${requirements[$name]}
  "${pip[@]}" install --progress-bar off "$root/client/python"
  "${pip[@]}" check
  "$venv/bin/python" -c 'import google.protobuf as p, grpc, laprox
from google.protobuf.internal import api_implementation
print("laprox from %s; protobuf %s (%s), grpcio %s"
      % (laprox.__file__, p.__version__, api_implementation.Type(), grpc.__version__))'
  if "$venv/bin/python" "$here/run_tests.py" --installed --laproxd "$laproxd" \
      "${test_args[@]}"; then
    echo "== $name: passed"
  else
    echo "== $name: FAILED"
    status=1
  fi
done
exit "$status"
