# Sourced by scripts that need a private laproxd for a while (tests/crosscheck/kvpress/run.sh,
# bench/quality/run.sh):
#
#   source "$root/scripts/lib/laproxd.sh"
#   start_laproxd BINARY TMPDIR [FLAG ...]   # sets laproxd_pid and socket ($TMPDIR/laproxd.sock)
#   trap stop_laproxd EXIT                   # stops it and removes TMPDIR
#
# It runs on the CPU backend without a metrics port, logs to TMPDIR/laproxd.log, and returns only
# once the socket exists (exits 1 with the log if laproxd dies or does not listen within 10 s).

start_laproxd() {
  local binary=$1
  laproxd_dir=$2
  shift 2
  socket="$laproxd_dir/laproxd.sock"
  "$binary" --socket="$socket" --metrics_listen= --backend=cpu "$@" \
    >"$laproxd_dir/laproxd.log" 2>&1 &
  laproxd_pid=$!
  for _ in $(seq 100); do
    [[ -S "$socket" ]] && break
    if ! kill -0 "$laproxd_pid" 2>/dev/null; then
      echo "laproxd exited:"; cat "$laproxd_dir/laproxd.log"; exit 1
    fi
    sleep 0.1
  done
  [[ -S "$socket" ]] || { echo "laproxd did not create $socket"; cat "$laproxd_dir/laproxd.log"; exit 1; }
  echo "== laproxd pid $laproxd_pid on unix:$socket"
}

stop_laproxd() {
  kill "$laproxd_pid" 2>/dev/null || true
  wait "$laproxd_pid" 2>/dev/null || true
  rm -rf "$laproxd_dir"
}
