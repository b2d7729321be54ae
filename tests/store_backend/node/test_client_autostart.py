"""Auto-start: a client that finds no service starts one (``python -m store_backend.node serve`` in a
session of its own), exactly one however many processes find it missing at once; the service
outlives its starter; a service that fails at start surfaces its log's last lines. Real processes
throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from store_backend.config import ConfigError
from store_backend.node.autostart import ServiceProcess
from store_backend.node.client import NodeClient, probe
from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload, short_socket_dir

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20


def _config(directory: Path, **store: object) -> Path:
    f = directory / "node.json"
    f.write_text(json.dumps({
        "store": {"dram": {"capacity_bytes": 8 * MiB, "shm_name": f"mkv-as-{uuid.uuid4().hex[:10]}", **store}},
        "socket": str(directory / "node.sock"), "metrics": None, "drain_timeout_s": 1.0}))
    return f


def _stop(sock: str) -> None:
    """SIGTERM the service answering at ``sock`` and wait until nothing answers."""
    welcome = probe(sock)
    if welcome is None:
        return
    os.kill(welcome.service_pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while probe(sock) is not None or _alive(welcome.service_pid):
        assert time.monotonic() < deadline, "the service did not stop"
        time.sleep(0.05)  # poll interval; the loop has a deadline


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped by its starter yet) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def node_dir():
    d = short_socket_dir()
    yield d
    _stop(str(d / "node.sock"))
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


STARTER = textwrap.dedent("""
    import json, sys, time
    from store_backend.node.autostart import ServiceProcess
    from store_backend.node.client import NodeClient
    sock, config, key, go_at = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    starter = ServiceProcess(sock, config, idle_exit_s=None, start_timeout_s=60)
    started = []
    def start():
        started.append(starter.ensure())
    while time.time() < go_at:
        time.sleep(0.001)  # every racer starts at the same instant, by design
    c = NodeClient(sock, starter=start).start()
    status = c.put([key], [key.encode() * 100])[0]
    print(json.dumps({"started": started, "status": int(status), "service_pid": c.welcome.service_pid}))
    c.close(flush=False)
    starter.close()
""")


def test_two_processes_at_once_start_one_service_that_outlives_them(node_dir) -> None:
    config = _config(node_dir)
    sock = str(node_dir / "node.sock")
    go_at = time.time() + 1.5  # both start their connect in the same millisecond
    procs = [subprocess.Popen([sys.executable, "-c", STARTER, sock, str(config), f"key{i}", str(go_at)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(sum((o["started"] for o in outs), [])) in ([True], [False, True]), outs
    assert [o["status"] for o in outs] == [Status.OK, Status.OK]
    assert outs[0]["service_pid"] == outs[1]["service_pid"]  # one service
    # Both starters have exited: the service still answers and holds both objects.
    c = NodeClient(sock).start()
    try:
        out = bytearray(400)
        assert c.get_into(["key0", "key1"], [out, bytearray(400)]) == [ReadResult(Status.OK, 400)] * 2
        stats = c.service_stats()
        assert stats is not None and stats[1].auto_started
        assert stats[1].started_by in [p.pid for p in procs]
    finally:
        c.close(flush=False)
    log = (node_dir / "node.log").read_text()
    assert log.count(" starts: ") == 1 and "--started-by" in log


def test_a_client_with_a_starter_starts_the_service_and_starts_it_again_after_it_died(node_dir) -> None:
    config = _config(node_dir)
    sock = str(node_dir / "node.sock")
    starter = ServiceProcess(sock, str(config), idle_exit_s=None, start_timeout_s=60)
    c = NodeClient(sock, starter=starter, op_timeout_s=5).start()
    try:
        assert c.counters.auto_starts == 1 and starter.process is not None
        first = starter.process
        assert c.put(["k"], [payload("k", 1000)]) == [Status.OK]
        first.send_signal(signal.SIGKILL)
        first.wait(10)  # (the reaper may have reaped it already)
        # a miss either way: the lost service's IO_ERROR, or (the call retried on a fresh connection,
        # which started a new service) NOT_FOUND; never the bytes
        assert c.get_into(["k"], [bytearray(1000)])[0].status in (Status.IO_ERROR, Status.NOT_FOUND)
        deadline = time.monotonic() + 60
        while c.put(["k2"], [payload("k2", 10)]) != [Status.OK]:
            assert time.monotonic() < deadline, "no second start"
            time.sleep(0.05)  # poll interval; the loop has a deadline
        assert c.counters.auto_starts == 2 and starter.process is not first
        assert starter.process.poll() is None
        # DRAM only: what the killed service held is gone, never served from a stale segment
        assert c.get_into(["k"], [bytearray(1000)]) == [ReadResult(Status.NOT_FOUND)]
    finally:
        c.close(flush=False)
        starter.close()
    # Owned: the reaper thread is stopped by close.
    assert not [t for t in threading.enumerate() if t.name == "node-service-reaper"]


def test_a_service_that_fails_at_start_raises_with_its_log(node_dir) -> None:
    # Parses, but the arena cannot be made: serve exits 2, naming the field.
    config = _config(node_dir, capacity_bytes=1 << 50)
    sock = str(node_dir / "node.sock")
    starter = ServiceProcess(sock, str(config), start_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"(?s)exited with status 2 before it answered.*node\.log.*capacity_bytes"):
        starter.ensure()
    assert time.monotonic() - t0 < 30
    c = NodeClient(sock, starter=starter)
    with pytest.raises(ConfigError, match=r"(?s)capacity_bytes.*not started again"):
        c.start()  # start() says why; later calls answer misses
    assert c.exists(["k"]) == 0 and c.put(["k"], [b"x"]) == [Status.IO_ERROR]
    # a broken config is not respawned at every reconnect: one start in the log
    assert (node_dir / "node.log").read_text().count(" starts: ") == 1
    c.close(flush=False)
    starter.close()


def test_a_config_for_another_socket_is_refused_before_anything_starts(node_dir, tmp_path) -> None:
    other = short_socket_dir()
    try:
        config = _config(other)
        starter = ServiceProcess(str(node_dir / "node.sock"), str(config))
        with pytest.raises(ConfigError, match=r"node\.socket"):
            starter.ensure()
        assert starter.process is None
    finally:
        other.joinpath("node.json").unlink()
        other.rmdir()
