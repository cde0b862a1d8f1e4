#!/usr/bin/env bash
# Runs the demo inside the CPU image that deploy/oci/build-cpu-image.sh made, without a container
# engine: the OCI archive is unpacked into a runtime bundle (umoci), and laproxd starts in the
# bundle's root filesystem as the image's config says (its entrypoint, user and environment;
# ports moved to loopback port 0 so nothing here is exposed), chrooted in a mount and PID
# namespace of its own with /proc and /dev (and /dev/shm with it). Then, in the same root
# filesystem, `laprox-cli demo` and the image's health probe (`laprox-cli health`) run against
# it, and laproxd is stopped with SIGTERM. Exit 0 when the demo's plan came back, the probe said
# SERVING and laproxd exited 0.
#
#   tests/deploy/image_demo.sh [OUT_DIR]     # default build-image/ (needs root, umoci, python3)
set -euo pipefail
cd "$(dirname "$0")/../.."

out=$(realpath -m "${1:-build-image}")
work=$(mktemp -d "${TMPDIR:-/tmp}/laprox-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/oci"
tar -C "$work/oci" -xf "$out/laprox-cpu.oci.tar"
umoci unpack --image "$work/oci:cpu" "$work/bundle" >/dev/null

# The image's process as its config gives it: user, environment, entrypoint.
read -r user env_file args_file < <(/usr/bin/python3 - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
process = json.load(open(f"{work}/bundle/config.json"))["process"]
env = [e for e in process["env"] if not e.startswith(("LAPROXD_METRICS_LISTEN=",
                                                       "LAPROXD_HEALTH_LISTEN="))]
env += ["LAPROXD_METRICS_LISTEN=127.0.0.1:0", "LAPROXD_HEALTH_LISTEN=127.0.0.1:0"]
open(f"{work}/env", "w").write("\n".join(env) + "\n")
open(f"{work}/args", "w").write("\n".join(process["args"]) + "\n")
print(f'{process["user"]["uid"]}:{process["user"]["gid"]}', f"{work}/env", f"{work}/args")
EOF
)
echo "== the image's process: user $user, $(paste -sd' ' "$args_file"); $(paste -sd' ' "$env_file")"

unshare --mount --pid --fork --mount-proc bash -s "$work/bundle/rootfs" "$user" "$env_file" \
  "$args_file" <<'EOF'
set -euo pipefail
root=$1 user=$2
mapfile -t env <"$3"
mapfile -t args <"$4"
mount --make-rprivate /
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
inside() { chroot --userspec="$user" "$root" /usr/bin/env -i "${env[@]}" "$@"; }

# chroot and env exec: $! is laproxd itself, which SIGTERM below must reach.
chroot --userspec="$user" "$root" /usr/bin/env -i "${env[@]}" "${args[@]}" \
  >"$root/tmp/laproxd.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  [[ -S "$root/run/laprox/laproxd.sock" ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$root/tmp/laproxd.log"; echo "FAIL: laproxd exited"; exit 1; }
  sleep 0.1
done
cat "$root/tmp/laproxd.log"
inside laprox-cli demo --target=unix:/run/laprox/laproxd.sock | tee "$root/tmp/demo.out"
grep -q "^kept [0-9]* of [0-9]* (layer, KV head, token) entries" "$root/tmp/demo.out" ||
  { echo "FAIL: the demo printed no plan"; exit 1; }
inside laprox-cli health --target=unix:/run/laprox/laproxd.sock ||
  { echo "FAIL: the health probe did not say SERVING"; exit 1; }
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
[[ $rc -eq 0 ]] || { cat "$root/tmp/laproxd.log"; echo "FAIL: laproxd exited $rc"; exit 1; }
echo "== the demo ran in the image as uid ${user%%:*}; the health probe said SERVING; laproxd exited 0"
EOF
