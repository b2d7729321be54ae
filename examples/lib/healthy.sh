# Sourced by the example scripts (needs PY, the venv's python): healthy PORT PID waits until the
# vLLM server on 127.0.0.1:PORT answers /health, and exits the script with 1 if the process PID
# behind it exits first.
healthy() {  # $1: port; $2: pid of the server behind it
  until "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then echo "the server on port $1 exited before it was healthy" >&2; exit 1; fi
    sleep 2
  done
}

# first_exit PID...: waits until the first of these processes exits, says which one, and returns its
# exit status, so the script's cleanup stops the others instead of leaving a half-working set behind
# (a proxy that could not bind its port used to leave the script waiting on the servers forever).
# It polls: a child that exited before the call (while an earlier wait ran) counts too, and any
# bash the scripts run on has kill -0 and wait PID.
first_exit() {
  local p rc
  while true; do
    for p in "$@"; do
      if ! kill -0 "$p" 2>/dev/null; then
        rc=0
        wait "$p" 2>/dev/null || rc=$?
        echo "process $p exited with status $rc; stopping the others" >&2
        return "$rc"
      fi
    done
    sleep 1
  done
}
