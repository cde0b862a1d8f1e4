# Sourced by the scripts that need torch and kvpress from PyPI (tests/crosscheck/kvpress/run.sh,
# bench/quality/run.sh):
#
#   source "$root/scripts/lib/venv.sh"
#   ensure_torch_venv VENV STAMP_NAME "torch, kvpress" REQUIREMENTS...
#
# Creates VENV with ${PYTHON:-python3}: the CPU torch wheels of scripts/torch-cpu-wheels.txt,
# then every REQUIREMENTS file, all pinned and installed --no-deps; then checks that the modules
# (a Python import list) import. Reused while VENV/STAMP_NAME holds the text of those files and
# the modules import (~2.5 GB of downloads otherwise).

ensure_torch_venv() {
  local venv=$1 stamp_name=$2 modules=$3
  shift 3
  local wheels
  wheels="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/torch-cpu-wheels.txt"
  local stamp_text stamp="$venv/$stamp_name"
  stamp_text="$(cat "$wheels" "$@")"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] &&
     "$venv/bin/python" -c "import $modules" 2>/dev/null; then
    echo "== reusing $venv"
    return
  fi
  echo "== creating $venv (downloads ~2.5 GB from PyPI)"
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  local start requirements=()
  start=$(date +%s)
  "$venv/bin/pip" install --no-deps --progress-bar off -r "$wheels"
  for file in "$@"; do requirements+=(-r "$file"); done
  "$venv/bin/pip" install --no-deps --progress-bar off "${requirements[@]}"
  "$venv/bin/python" -c "import $modules; print('torch', torch.__version__, 'ok')"
  echo "== venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
  printf '%s' "$stamp_text" > "$stamp"
}
