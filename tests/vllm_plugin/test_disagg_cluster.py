"""The harness the 1P1D script tests start their cluster with (tests/vllm_plugin/disagg_cluster.py):
the ports it hands out, its retry when a port was taken meanwhile, and its failures. The scripts here
stand in for an example script (an HTTP server on ``PROXY_PORT``); the real scripts are run by
test_e2e_disagg.py and test_e2e_node_disagg.py."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from mooncake_kv.bench.ports import below_ephemeral
from tests.vllm_plugin.disagg_cluster import PortClash, free_port, script_cluster

# Serves /health on PROXY_PORT. With CLASH set, the first start (no marker file yet) fails the way a
# server whose port was taken does, and leaves the marker for the next start.
SCRIPT = f"""set -euo pipefail
if [ -n "${{CLASH:-}}" ] && [ ! -e "$MARKER" ]; then
  touch "$MARKER"; echo "OSError: [Errno 98] Address already in use" >&2; exit 1
fi
echo "started on $PROXY_PORT" >> "$STARTS"
exec {sys.executable} -c '
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PROXY_PORT"])), H).serve_forever()'
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "MARKER": str(tmp_path / "marker"), "STARTS": str(tmp_path / "starts"), **extra}


def _script(tmp_path: Path, text: str = SCRIPT) -> Path:
    path = tmp_path / "cluster.sh"
    path.write_text(text)
    return path


def test_free_port_is_bindable_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low, high = below_ephemeral()
    got = [free_port() for _ in range(20)]
    assert len(set(got)) == len(got)
    for port in got:
        if high - low > 1000:
            assert low <= port < high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_taken_meanwhile_starts_the_script_again_on_fresh_ports(tmp_path: Path) -> None:
    with script_cluster(_script(tmp_path), tmp_path, _env(tmp_path, CLASH="1")) as ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['proxy']}/health", timeout=5) as r:
            assert r.status == 200
    assert (tmp_path / "marker").exists()  # the first start did clash
    assert (tmp_path / "starts").read_text() == f"started on {ports['proxy']}\n"
    assert "Address already in use" in (tmp_path / "cluster.log").read_text()
    assert (tmp_path / "cluster.2.log").exists()


def test_a_port_clash_on_every_attempt_fails_with_the_log(tmp_path: Path) -> None:
    with pytest.raises(PortClash, match="Address already in use"):
        with script_cluster(_script(tmp_path), tmp_path, _env(tmp_path, CLASH="1"), attempts=1):
            pass


def test_a_script_that_fails_otherwise_is_not_retried(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "the model is missing" >&2; exit 2\n')
    with pytest.raises(AssertionError, match="exited with 2:\n.*the model is missing") as info:
        with script_cluster(script, tmp_path, _env(tmp_path)):
            pass
    assert not isinstance(info.value, PortClash)
    assert not (tmp_path / "cluster.2.log").exists()
