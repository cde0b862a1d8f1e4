#!/usr/bin/env bash
# Prints the Debian/Ubuntu packages that provide the shared libraries the given programs link
# directly (their DT_NEEDED entries), one per line, for the runtime stage of the images to
# install: apt pulls in the rest. Deriving the list instead of naming it keeps one Dockerfile
# pattern for Debian 12 (libgrpc++1.51, libprotobuf32, libabsl20220623, ...) and Ubuntu 24.04
# (the same libraries renamed by the 64-bit time_t transition: libgrpc++1.51t64, ...).
# Libraries under /usr/local/cuda come from the CUDA runtime base image and are skipped.
#
#   deploy/docker/runtime-packages.sh build/service/laproxd build/client/laprox-cli
#
# Fails when a needed library is missing or owned by no package.
set -euo pipefail

if (($# == 0)); then
  echo "usage: $0 PROGRAM..." >&2
  exit 2
fi

# dpkg records /usr/lib/... while ldd may print /lib/... (merged /usr), or a symlink.
owner() {
  local path=$1 candidate
  for candidate in "$path" "$(readlink -f "$path")" "/usr$path" "${path#/usr}"; do
    [[ -n "$candidate" && "$candidate" == /* ]] || continue
    if dpkg-query -S "$candidate" 2>/dev/null | head -n 1 | cut -d: -f1; then return 0; fi
  done
  return 1
}

failed=0
packages=()
for program in "$@"; do
  resolved=$(ldd "$program")
  mapfile -t needed < <(readelf -d "$program" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for library in "${needed[@]}"; do
    path=$(awk -v lib="$library" '$1 == lib && $2 == "=>" {print $3}' <<<"$resolved")
    if [[ -z "$path" || "$path" == "not" ]]; then
      echo "runtime-packages: $program needs $library, which is not found" >&2
      failed=1
    elif [[ "$path" == /usr/local/cuda* ]]; then
      echo "runtime-packages: $library ($path) comes with the CUDA runtime image" >&2
    elif package=$(owner "$path") && [[ -n "$package" ]]; then
      packages+=("$package")
    else
      echo "runtime-packages: $library ($path) belongs to no package" >&2
      failed=1
    fi
  done
done
((failed == 0)) || exit 1
printf '%s\n' "${packages[@]}" | sort -u
