"""``store.node.auto_start`` through the connector's own path (``acquire_connector_store``), with real
processes: engine processes that find no service start exactly one, in a session of its own; it
outlives them (other engines may be attached), says in ``status`` who started it, exits on
``stop`` and by itself ``idle_exit_s`` after its last client left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store_backend.config import ConfigError
from tests.node_service import ROOT, service_env, short_socket_dir

pytestmark = pytest.mark.timeout(240)

# An engine process: attach through the connector's config, report, hold on, let go.
ENGINE = """
import json, sys, time
from mooncake_connector.config import load_connector_config
from mooncake_connector.ranks import RankPosition
from mooncake_connector.stores import acquire_connector_store, epoch_directory, release_store
cfg = load_connector_config(json.loads(sys.argv[1]), environ={})
store = acquire_connector_store(cfg, RankPosition(), name="engine")
print("ATTACHED", json.dumps({"pid": store.welcome.service_pid, "ssd": epoch_directory(cfg, store)}), flush=True)
time.sleep(float(sys.argv[2]))  # the engine holds its store this long, by design
release_store(store, flush=False)
"""


def _engines(extra: dict, n: int, hold_s: float) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE, json.dumps(extra), str(hold_s)], cwd=ROOT,
                              env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("ATTACHED "))
        out.append({"engine_pid": p.pid, **json.loads(line[len("ATTACHED "):])})
    return out


def _cli(command: str, socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "store_backend.node", command, "--socket", socket, *args],
                          capture_output=True, text=True, cwd=ROOT, env=service_env(), timeout=120)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)  # poll interval; the loop has a deadline
    return False


def test_two_engines_at_once_start_one_service_that_outlives_them(tmp_path: Path) -> None:
    socket = os.path.join(short_socket_dir(), "node.sock")
    service = tmp_path / "node.json"
    service.write_text(json.dumps({"socket": socket, "metrics": None,
                                   "store": {"dram": {"capacity_bytes": "16MiB", "shm_name": f"mkv-as-{os.getpid()}"},
                                             "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": "64MiB"}}}))
    extra = {"store": {"node": {"socket": socket, "auto_start": True, "config_file": str(service)}}}
    got = _engines(extra, 2, 1.0)
    pids = {g["pid"] for g in got}
    assert len(pids) == 1, got  # one service for both
    (pid,) = pids
    assert pid not in {g["engine_pid"] for g in got}
    assert {g["ssd"] for g in got} == {str(tmp_path / "ssd")}  # the epoch file goes beside its objects
    try:
        status = _cli("status", socket, "--json")
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        # Still serving after both engines exited; it says it was auto-started, and by whom.
        assert doc["pid"] == pid and doc["auto_started"] is True
        assert doc["started_by"] in {g["engine_pid"] for g in got}
        assert os.getsid(pid) == pid  # a session of its own: the engine terminal's Ctrl-C does not reach it
        assert "starts:" in Path(socket).with_name("node.log").read_text()
    finally:
        stopped = _cli("stop", socket, "--wait", "60")
    assert stopped.returncode == 0, stopped.stderr
    assert _wait_gone(pid, 30)
    assert _cli("status", socket).returncode == 1


def test_auto_start_without_a_config_file_runs_the_service_defaults_and_exits_when_idle() -> None:
    socket = os.path.join(short_socket_dir(), "node.sock")
    extra = {"store": {"node": {"socket": socket, "auto_start": True, "idle_exit_s": 2}}}
    (got,) = _engines(extra, 1, 0.1)
    assert got["ssd"] is None  # the defaults: DRAM only (the epoch then lives in memory)
    config = json.loads(Path(socket).with_name("autostart-config.json").read_text())
    assert config == {"socket": socket}
    # Its last (only) client left: it exits by itself after idle_exit_s.
    assert _wait_gone(got["pid"], 60), _cli("status", socket).stdout


def test_without_auto_start_a_missing_service_names_the_field() -> None:
    from mooncake_connector.config import load_connector_config
    from mooncake_connector.ranks import RankPosition
    from mooncake_connector.stores import acquire_connector_store

    socket = os.path.join(short_socket_dir(), "node.sock")
    cfg = load_connector_config({"store": {"node": {"socket": socket, "connect_timeout_s": 1}}}, environ={})
    with pytest.raises(ConfigError, match=r"^store\.node\.socket: cannot attach to the node service at .*"
                                          r"mooncake-kv serve --config FILE`, or set store\.node\.auto_start$"):
        acquire_connector_store(cfg, RankPosition(), name="t")


def test_an_auto_start_that_fails_shows_the_services_log(tmp_path: Path) -> None:
    from mooncake_connector.config import load_connector_config
    from mooncake_connector.ranks import RankPosition
    from mooncake_connector.stores import acquire_connector_store

    socket = os.path.join(short_socket_dir(), "node.sock")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    service = tmp_path / "node.json"
    # Valid as a config (read at once), failing at start: its SSD directory cannot be made.
    service.write_text(json.dumps({"socket": socket, "metrics": None,
                                   "store": {"ssd": {"path": str(blocker / "ssd")}}}))
    cfg = load_connector_config({"store": {"node": {"socket": socket, "auto_start": True,
                                                    "config_file": str(service)}}}, environ={})
    with pytest.raises(ConfigError, match=r"exited with status \d+ before it answered.*last lines of .*node\.log"):
        acquire_connector_store(cfg, RankPosition(), name="t")
