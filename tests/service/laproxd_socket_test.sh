#!/usr/bin/env bash
# laproxd's socket is its own: the directory is created 0750 and the socket 0660 (no moment with
# other bits: it is bound under a umask); a second laproxd on a live socket exits non-zero naming
# the first, which keeps serving; a regular file, a directory or a symlink at the path is left
# alone and start-up fails naming it; a stale socket (nobody listening) is replaced; a foreign
# server's live socket is not taken over; --socket_mode is applied and a bad one refused;
# SIGTERM removes the socket and its lock file and exits 0; without --socket a non-root laproxd
# listens under $XDG_RUNTIME_DIR/laprox/, and without it at /run/laprox/laproxd.sock (run as uid
# 65534 when this test runs as root).
#
#   laproxd_socket_test.sh PATH/TO/laproxd PATH/TO/laprox-cli
set -euo pipefail
laproxd=$1
cli=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/laproxd-socket.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

start() {  # LOG ARGS... : starts laproxd in the background, sets $pid, waits for "listening on"
  local log=$1
  shift
  "$laproxd" --backend=cpu --metrics_listen= "$@" >"$log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1 200); do
    grep -q "listening on" "$log" && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log"; fail "laproxd exited early: $*"; }
    sleep 0.1
  done
  cat "$log"
  fail "laproxd did not listen: $*"
}

refused() {  # MESSAGE ARGS... : laproxd must exit non-zero within 20 s, printing MESSAGE
  local message=$1
  shift
  local rc=0
  timeout 20 "$laproxd" --backend=cpu --metrics_listen= "$@" >"$dir/refused.log" 2>&1 || rc=$?
  [[ $rc -ne 0 && $rc -ne 124 ]] || { cat "$dir/refused.log"; fail "not refused (rc $rc): $*"; }
  grep -qF -- "$message" "$dir/refused.log" || { cat "$dir/refused.log"; fail "message: $*"; }
}

# 1. The directory is created 0750, the socket born 0660.
run=$dir/run
socket=$run/laproxd.sock
start "$dir/first.log" --socket="$socket"
first=$pid
[[ "$(stat -c '%a' "$run")" == 750 ]] || fail "directory mode $(stat -c '%a' "$run")"
[[ "$(stat -c '%a' "$socket")" == 660 ]] || fail "socket mode $(stat -c '%a' "$socket")"
"$cli" info --target="unix:$socket" | grep -q "laproxd" || fail "first laproxd does not answer"

# 2. A second laproxd on the live socket is refused, naming the first; the first still serves.
refused "another laproxd (pid $first) serves $socket" --socket="$socket"
"$cli" info --target="unix:$socket" | grep -q "laproxd" || fail "the first stopped serving"
[[ -S "$socket" ]] || fail "the socket is gone"

# 3. SIGTERM: exit 0, the socket and its lock file removed.
kill -TERM "$first"
rc=0
wait "$first" || rc=$?
[[ $rc -eq 0 ]] || { cat "$dir/first.log"; fail "SIGTERM exit $rc"; }
[[ ! -e "$socket" ]] || fail "the socket was not removed at exit"
[[ ! -e "$socket.lock" ]] || fail "the lock file was not removed at exit"
start "$dir/again.log" --socket="$socket"  # the path is free again
kill -TERM "$pid"
wait "$pid" || fail "second start did not stop cleanly"

# 4. Not a socket: left alone, start-up fails naming it.
echo keep >"$dir/file"
refused "$dir/file exists and is a regular file" --socket="$dir/file"
[[ "$(cat "$dir/file")" == keep ]] || fail "the regular file was changed"
mkdir "$dir/adir"
refused "$dir/adir exists and is a directory" --socket="$dir/adir"
[[ -d "$dir/adir" ]] || fail "the directory was removed"
ln -s "$dir/file" "$dir/link"
refused "$dir/link exists and is a symbolic link" --socket="$dir/link"
[[ -L "$dir/link" && "$(cat "$dir/file")" == keep ]] || fail "the symlink or its target changed"

# 5. A stale socket (bound, nobody listening) is replaced; a foreign live one is not.
python3 -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' \
  "$dir/stale.sock"
[[ -S "$dir/stale.sock" ]] || fail "could not make a stale socket"
start "$dir/stale.log" --socket="$dir/stale.sock"
"$cli" info --target="unix:$dir/stale.sock" | grep -q "laproxd" || fail "not serving on stale"
kill -TERM "$pid"
wait "$pid" || true
python3 - "$dir/foreign.sock" "$dir/foreign.ready" <<'EOF' &
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(4)
open(sys.argv[2], "w").close()
time.sleep(60)
EOF
foreign=$!
pids+=("$foreign")
for _ in $(seq 1 100); do [[ -e "$dir/foreign.ready" ]] && break; sleep 0.1; done
refused "accepts connections on $dir/foreign.sock" --socket="$dir/foreign.sock"
[[ -S "$dir/foreign.sock" ]] || fail "the foreign socket was removed"
kill "$foreign"

# 6. --socket_mode is applied; a bad mode is refused.
start "$dir/mode.log" --socket="$dir/mode.sock" --socket_mode=0600
[[ "$(stat -c '%a' "$dir/mode.sock")" == 600 ]] || fail "socket_mode 0600 not applied"
kill -TERM "$pid"
wait "$pid" || true
refused "--socket_mode=0999 is not an octal number" --socket="$dir/bad.sock" --socket_mode=0999
refused "--socket_mode=01777 is not in [0, 0777]" --socket="$dir/bad.sock" --socket_mode=1777

# 7. The default path of a non-root laproxd: $XDG_RUNTIME_DIR/laprox/laproxd.sock.
if [[ $(id -u) -eq 0 ]] && command -v setpriv >/dev/null; then
  xdg=$dir/xdg
  mkdir -m 0700 "$xdg"
  chown 65534:65534 "$xdg"
  chmod o+x "$dir"
  XDG_RUNTIME_DIR=$xdg setpriv --reuid=65534 --regid=65534 --clear-groups \
    "$laproxd" --backend=cpu --metrics_listen= >"$dir/user.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1 200); do
    grep -q "listening on" "$dir/user.log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$dir/user.log"; fail "non-root laproxd exited"; }
    sleep 0.1
  done
  grep -q "listening on unix:$xdg/laprox/laproxd.sock" "$dir/user.log" ||
    { cat "$dir/user.log"; fail "non-root default path"; }
  [[ "$(stat -c '%u %a' "$xdg/laprox")" == "65534 750" ]] || fail "XDG directory owner/mode"
  kill -TERM "$pid"
  wait "$pid" || true
  # Without XDG_RUNTIME_DIR the default is the system-wide /run/laprox/laproxd.sock (where the
  # clients look too: laprox/v1/endpoint.h); a user who may not create it gets a clear refusal
  # naming the path and the way out.
  if [[ ! -e /run/laprox ]]; then
    rc=0
    env -u XDG_RUNTIME_DIR setpriv --reuid=65534 --regid=65534 --clear-groups \
      "$laproxd" --backend=cpu --metrics_listen= >"$dir/nouser.log" 2>&1 || rc=$?
    [[ $rc -ne 0 ]] && grep -q "socket=auto is /run/laprox/laproxd.sock: give --socket, or set XDG_RUNTIME_DIR" "$dir/nouser.log" ||
      { cat "$dir/nouser.log"; fail "no default path without XDG_RUNTIME_DIR"; }
  fi
else
  echo "SKIP part 7: the non-root default path needs root and setpriv to switch users"
fi
echo PASS
