"""examples/lib/healthy.sh, the waits the example scripts source: ``healthy`` returns once the server
answers /health, and ends the script with 1 (naming the port) when the server's process exits first;
``first_exit`` returns the status of the first of several processes to exit."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "examples" / "lib" / "healthy.sh"


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; PY={sys.executable}; . "{LIB}"; {script}'],
                          capture_output=True, text=True, timeout=60)


def test_a_server_that_answers_health_is_waited_for() -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        out = _run(f"healthy {srv.server_address[1]} $$; echo waited")
    finally:
        srv.shutdown()
        srv.server_close()
    assert out.returncode == 0 and out.stdout == "waited\n", out


def test_a_server_that_exits_first_ends_the_script_with_1() -> None:
    out = _run("sleep 0 & dead=$!; wait $dead; healthy 1 $dead; echo not reached")
    assert out.returncode == 1, out
    assert out.stdout == "" and "the server on port 1 exited before it was healthy" in out.stderr, out


def test_first_exit_returns_when_the_first_process_exits_with_its_status() -> None:
    # The long sleeper would keep a plain `wait` going for 50 s; first_exit returns on the quick one.
    out = _run("sleep 50 & slow=$!; (sleep 0.2; exit 3) & quick=$!; rc=0; first_exit $slow $quick || rc=$?; "
               "kill $slow; echo rc=$rc quick=$quick")
    assert out.returncode == 0, out
    quick = out.stdout.split("quick=")[1].strip()
    assert out.stdout.startswith("rc=3 "), out
    assert f"process {quick} exited with status 3; stopping the others" in out.stderr, out


def test_first_exit_under_set_e_ends_the_script_with_the_status() -> None:
    out = _run("(exit 5) & p=$!; first_exit $p; echo not reached")
    assert out.returncode == 5 and out.stdout == "", out


def test_first_exit_counts_a_process_that_exited_before_the_call() -> None:
    # bash forgets a finished child at its next command: the first child has exited (and been
    # reaped) before first_exit starts, while the second runs for 20 s.
    out = _run("(exit 3) & early=$!; sleep 0.3; x=$(echo hi); sleep 20 & slow=$!; SECONDS=0; rc=0; "
               "first_exit $slow $early || rc=$?; kill $slow; echo rc=$rc took=$SECONDS")
    assert out.returncode == 0, out
    assert out.stdout.startswith("rc=3 "), out
    assert int(out.stdout.split("took=")[1]) < 10, out
