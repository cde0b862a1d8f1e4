# Pinned virtual environments from PyPI, reused while their pins are unchanged. Sourced by
# tests/integration/vllm/setup.sh (ensure_venv) and by the scripts that need torch and kvpress
# (tests/crosscheck/kvpress/run.sh, bench/quality/run.sh: ensure_torch_venv).
#
#   source "$root/scripts/lib/venv.sh"
#   ensure_venv VENV STAMP STAMP_TEXT PYTHON MODULES REQUIREMENTS...
#   ensure_torch_venv VENV STAMP_NAME "torch, kvpress" REQUIREMENTS...
#
# ensure_venv reuses VENV while the file STAMP holds STAMP_TEXT and MODULES (a Python import
# list) import; otherwise it creates VENV with PYTHON, installs every REQUIREMENTS file (all
# pinned) with --no-deps in one pip call, checks that MODULES import and writes the stamp.
# ensure_torch_venv is ensure_venv with ${PYTHON:-python3}, the CPU torch wheels of
# scripts/torch-cpu-wheels.txt before the REQUIREMENTS, and VENV/STAMP_NAME holding the text of
# those files (~2.5 GB of downloads when it is made).

ensure_venv() {
  local venv=$1 stamp=$2 stamp_text=$3 python=$4 modules=$5
  shift 5
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] &&
     "$venv/bin/python" -c "import $modules" 2>/dev/null; then
    echo "== reusing $venv"
    return
  fi
  echo "== creating $venv with $("$python" --version 2>&1) (downloads from PyPI)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  local start file requirements=()
  start=$(date +%s)
  for file in "$@"; do requirements+=(-r "$file"); done
  "$venv/bin/pip" install --no-deps --progress-bar off "${requirements[@]}"
  "$venv/bin/python" -c "import $modules"
  echo "== venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
  printf '%s' "$stamp_text" > "$stamp"
}

ensure_torch_venv() {
  local venv=$1 stamp_name=$2 modules=$3
  shift 3
  local wheels
  wheels="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/torch-cpu-wheels.txt"
  ensure_venv "$venv" "$venv/$stamp_name" "$(cat "$wheels" "$@")" "${PYTHON:-python3}" \
    "$modules" "$wheels" "$@"
}
