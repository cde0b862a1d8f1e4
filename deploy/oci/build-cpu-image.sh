#!/usr/bin/env bash
# The CPU image `laprox:cpu`, built without a container engine and without pulling any base
# image: the release build of laproxd and laprox-cli (scripts/build-release.sh), a Debian 12 root
# filesystem holding only the packages those two programs need (mmdebstrap, from Debian's
# archive: the essential set plus what deploy/docker/runtime-packages.sh lists), the `laprox`
# user (10001, non-root) and /run/laprox, then an OCI image archive (umoci). The image is what
# deploy/docker/Dockerfile.cpu describes: the same user, environment, ports, entrypoint and
# health probe (`laprox-cli health`).
#
#   deploy/oci/build-cpu-image.sh [OUT_DIR]     # default build-image/
#
# Writes OUT_DIR/laprox-cpu.oci.tar (an OCI image layout, tag `cpu`; load it with
# `podman load -i`, or push it with `skopeo copy oci-archive:OUT_DIR/laprox-cpu.oci.tar:cpu
# docker://REGISTRY/laprox:cpu`) and prints its size and the build's time. Needs root (mmdebstrap
# and umoci unpack files owned by other users) and Debian's archive; installs mmdebstrap and umoci
# with scripts/install-deps.sh --image. tests/deploy/image_demo.sh runs the demo inside the result.
set -euo pipefail
cd "$(dirname "$0")/../.."

out=$(realpath -m "${1:-build-image}")
build_dir=${BUILD_DIR:-build-release}
start=$(date +%s)

scripts/install-deps.sh --image
BUILD_DIR="$build_dir" LAPROX_CMAKE_ARGS="-DLAPROX_CUDA=OFF ${LAPROX_CMAKE_ARGS:-}" \
  scripts/build-release.sh
programs=("$build_dir/service/laproxd" "$build_dir/client/laprox-cli")
packages=$(deploy/docker/runtime-packages.sh "${programs[@]}" | paste -sd,)
built=$(date +%s)

rm -rf "$out"
mkdir -p "$out"
echo "== root filesystem: Debian 12 essential + $packages"
# No documentation, manual pages or translations: nothing in the image reads them. The hooks are
# in single quotes: mmdebstrap passes the root filesystem's path as their $1.
# shellcheck disable=SC2016
mmdebstrap --variant=essential --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook="copy-in ${programs[*]} /usr/local/bin" \
  --customize-hook='echo "laprox:x:10001:10001:laprox:/nonexistent:/usr/sbin/nologin" >> "$1/etc/passwd"' \
  --customize-hook='echo "laprox:x:10001:" >> "$1/etc/group"' \
  --customize-hook='rm -rf "$1/var/cache/apt" "$1/var/lib/apt/lists" "$1/var/log"/*' \
  bookworm "$out/rootfs.tar"

echo "== OCI image (umoci)"
layout="$out/oci"
umoci init --layout "$layout"
umoci new --image "$layout:cpu"
umoci unpack --image "$layout:cpu" "$out/bundle" >/dev/null
tar -C "$out/bundle/rootfs" -xf "$out/rootfs.tar"
# The socket's directory (mmdebstrap empties /run at its end, so it is made here).
install -d -o 10001 -g 10001 -m 0770 "$out/bundle/rootfs/run/laprox"
umoci repack --image "$layout:cpu" "$out/bundle"
umoci config --image "$layout:cpu" \
  --author="laprox" --config.user=10001:10001 --config.workingdir=/ \
  --config.entrypoint=/usr/local/bin/laproxd \
  --config.env=PATH=/usr/local/bin:/usr/bin:/bin \
  --config.env=LAPROXD_SOCKET=/run/laprox/laproxd.sock \
  --config.env=LAPROXD_METRICS_LISTEN=0.0.0.0:9464 \
  --config.env=LAPROXD_HEALTH_LISTEN=0.0.0.0:9465 \
  --config.env=LAPROXD_BACKEND=cpu \
  --config.exposedports=9464/tcp --config.exposedports=9465/tcp \
  --config.label=org.opencontainers.image.title=laprox \
  --config.label=org.opencontainers.image.description="laproxd, the laprox KV-cache eviction sidecar (CPU backend); health: laprox-cli health --target=unix:/run/laprox/laproxd.sock"
umoci gc --layout "$layout"
tar -C "$layout" -cf "$out/laprox-cpu.oci.tar" .
rm -rf "$out/bundle" "$out/rootfs.tar"
done=$(date +%s)

size=$(stat -c %s "$out/laprox-cpu.oci.tar")
echo "== $out/laprox-cpu.oci.tar: $((size / 1024 / 1024)) MiB ($size bytes); build of the" \
  "programs $((built - start)) s, image $((done - built)) s"
