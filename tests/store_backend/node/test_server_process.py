"""The node service as its own process (``python -m store_backend.node serve``): SIGTERM with a
reservation open drains and exits 0 with the SSD consistent; a SIGKILLed service's segment is
unlinked at the next start and the new one is another inode; ``status``/``stop`` and their exit
statuses; ``/metrics``; 2000 idle connections cost no thread and little memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_kv import cli
from store_backend.node import protocol as p
from store_backend.node.metrics import NODE_FAMILIES
from store_backend.prometheus import store_families
from store_backend.store import TieredStore
from store_backend.types import Status

from .server_harness import (
    REPO,
    Raw,
    ServiceProcess,
    proc_status,
    segments_named,
    service_config,
    service_thread,
    wait_until,
)


def connect(path: str, **hello) -> Raw:
    c = Raw(path)
    w = c.hello(**hello)
    assert isinstance(w, p.Welcome), w
    return c


def test_sigterm_with_a_reservation_open_drains_commits_and_leaves_the_ssd_consistent(sdir, tmp_path):
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "io_engine": "posix"}
    cfg = service_config(sdir, store={"ssd": ssd}, drain_timeout_s=20.0)
    svc = ServiceProcess(cfg, sdir)
    try:
        svc.wait_ready()
        a = connect(svc.socket_path)
        stored = {f"t/{i}": os.urandom(64 << 10) for i in range(8)}
        for k, v in stored.items():
            a.put(k, v)
        late = os.urandom(256 << 10)
        g = a.ask(p.Reserve(0, ["t/late"], [len(late)])).grants[0]
        assert g.status == Status.OK
        a.mapping[g.offset:g.offset + 1000] = late[:1000]  # mid-copy when the signal comes
        svc.signal(signal.SIGTERM)
        push = a.read()
        assert isinstance(push, p.Draining) and push.deadline_s == 20.0
        refused = a.ask(p.Reserve(0, ["t/refused"], [4096]))
        assert isinstance(refused, p.Error) and refused.code == "closed"
        assert svc.proc.poll() is None  # waiting for the open reservation
        a.mapping[g.offset:g.offset + len(late)] = late
        assert a.ask(p.Commit(0, [g.token])).values == [Status.OK]
        assert svc.wait(60) == 0, svc.log_text()
        assert a.closed_by_peer()
        a.close()
        assert not os.path.exists(svc.socket_path)
        assert segments_named(cfg["store"]["dram"]["shm_name"]) == []
        # What was committed, the late one included, is on SSD for the next store.
        with TieredStore({"ssd": ssd, "dram": {"capacity_bytes": 16 << 20}}) as store:
            stored["t/late"] = late
            assert sorted(store.keys("t/")) == sorted(stored)
            for k, v in stored.items():
                buf = bytearray(len(v))
                assert store.get_into([k], [buf])[0].status == Status.OK and bytes(buf) == v
    finally:
        svc.close()


def test_a_second_sigterm_skips_the_drain(sdir):
    cfg = service_config(sdir, drain_timeout_s=60.0)
    svc = ServiceProcess(cfg, sdir)
    try:
        svc.wait_ready()
        a = connect(svc.socket_path)
        assert a.ask(p.Reserve(0, ["x/1"], [4096])).grants[0].status == Status.OK
        t0 = time.monotonic()
        svc.signal(signal.SIGTERM)
        assert isinstance(a.read(), p.Draining)
        time.sleep(0.3)  # the window in which the drain (a reservation is open) must keep the service up
        assert svc.proc.poll() is None
        svc.signal(signal.SIGINT)
        svc.wait(30)
        assert time.monotonic() - t0 < 20
        assert "skipping the waits" in svc.log_text()
        a.close()
    finally:
        svc.close()


def test_a_killed_services_segment_is_unlinked_at_the_next_start_and_the_new_one_is_another_inode(sdir):
    cfg = service_config(sdir)
    shm_name = cfg["store"]["dram"]["shm_name"]
    first = ServiceProcess(cfg, sdir)
    second = None
    try:
        first.wait_ready()
        old = connect(first.socket_path)
        old.put("s/1", b"old" * 1000)
        old_id = old.welcome.segment_id
        old_names = segments_named(shm_name)
        assert len(old_names) == 1
        first.proc.kill()
        first.wait(30)
        assert segments_named(shm_name) == old_names  # SIGKILL left it behind
        first.close(unlink_leftovers=False)  # the next start is to remove it
        second = ServiceProcess(cfg, sdir)
        second.wait_ready()
        names = segments_named(shm_name)
        assert len(names) == 1 and names != old_names  # the old one unlinked, a new one made
        new = connect(second.socket_path)
        assert new.welcome.segment_id != old_id
        # A client of the dead service still maps the old inode: its late writes land there only.
        new.put("s/2", b"n" * 4096)
        g = new.ask(p.Lease(0, ["s/2"])).grants[0]
        old.mapping[g.offset:g.offset + 4096] = b"L" * 4096  # the same offset, in the old segment
        assert bytes(new.mapping[g.offset:g.offset + 4096]) == b"n" * 4096
        assert new.ask(p.Release(0, [g.token])).values == [True]
        assert new.get("s/2") == b"n" * 4096
        assert new.ask(p.Exists(0, ["s/1"])).n == 0
        new.close()
        old.close()
        second.signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        first.close()
        if second is not None:
            second.close()


def test_status_json_schema_exit_statuses_and_stop(sdir, capsys):
    cfg = service_config(sdir, metrics={"host": "127.0.0.1", "port": 0})
    sock = cfg["socket"]
    assert cli.main(["status", "--socket", sock, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["ready"] is False and doc["socket"] == sock and "no node service answers" in doc["error"]
    svc = ServiceProcess(cfg, sdir, "--started-by", str(os.getpid()), "--idle-exit-s", "600")
    try:
        svc.wait_ready()
        c = connect(sock, name="engine-0")
        c.put("j/1", b"a" * 8192)
        assert c.get("j/1") == b"a" * 8192
        assert c.get("j/missing") is None
        assert c.ask(p.Reserve(0, ["j/2"], [4096])).grants[0].status == Status.OK
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json"],
                             capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert set(doc) >= {"ready", "socket", "pid", "uptime_s", "auto_started", "started_by", "segment", "tiers",
                            "queues", "connections", "reservations", "leases", "held_bytes", "zombie_bytes",
                            "clients", "metrics"}
        assert doc["ready"] is True and doc["pid"] == svc.proc.pid and doc["pool"] is None
        assert doc["auto_started"] is True and doc["started_by"] == os.getpid()
        assert doc["segment"]["bytes"] == 16 << 20 and doc["segment"]["path"].startswith("/dev/shm/")
        assert set(doc["tiers"]) == {"dram"}
        dram = doc["tiers"]["dram"]
        assert set(dram) == {"used_bytes", "capacity_bytes", "objects", "hits", "misses", "hit_rate", "evictions",
                             "failures"}
        assert dram["objects"] >= 1 and dram["used_bytes"] >= 8192 and dram["capacity_bytes"] == 16 << 20
        assert dram["hits"] == 1 and dram["misses"] == 1 and dram["hit_rate"] == 0.5
        assert doc["reservations"] == 1 and doc["held_bytes"] == 4096
        engine = [cl for cl in doc["clients"] if cl["name"] == "engine-0"]
        assert len(engine) == 1 and engine[0]["reservations"] == 1 and engine[0]["held_bytes"] == 4096
        assert engine[0]["pid"] == os.getpid()
        # The table form names the same things.
        assert cli.main(["status", "--socket", sock]) == 0
        table = capsys.readouterr().out
        assert "engine-0" in table and "dram" in table and str(svc.proc.pid) in table
        assert cli.main(["status", "--socket", sock, "--json", "--wait", "5"]) == 0
        capsys.readouterr()
        c.close()
        assert cli.main(["stop", "--socket", sock, "--wait", "30"]) == 0
        assert svc.wait(5) == 0
        assert cli.main(["status", "--socket", sock, "--json"]) == 1
        assert cli.main(["stop", "--socket", sock]) == 1
    finally:
        svc.close()


def test_status_wait_waits_for_a_service_that_is_starting(sdir):
    cfg = service_config(sdir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    waiter = subprocess.Popen([sys.executable, "-m", "store_backend.node", "status", "--socket", cfg["socket"],
                               "--json", "--wait", "60"], stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    svc = None
    try:
        # A stand-in listener at the socket meets one of the waiter's probes (and hangs up): the
        # waiter is waiting before the service starts.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stand_in:
            stand_in.bind(cfg["socket"])
            stand_in.listen(1)
            stand_in.settimeout(60)
            stand_in.accept()[0].close()
        os.unlink(cfg["socket"])
        svc = ServiceProcess(cfg, sdir)
        out, _ = waiter.communicate(timeout=90)
        assert waiter.returncode == 0 and json.loads(out)["ready"] is True
    finally:
        if waiter.poll() is None:
            waiter.kill()
        if svc is not None:
            svc.close()


def test_status_of_a_service_that_refuses_the_user_exits_2(sdir, capsys):
    """A socket the user may not connect to (another user's, mode 0600) is a permission problem,
    not "not running"."""
    if os.getuid() != 0:
        pytest.skip("needs root to make the socket another user's")
    cfg = service_config(sdir)
    with service_thread(cfg) as svc:
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                code = cli.main(["status", "--socket", svc.socket_path, "--json"])
            except BaseException:  # noqa: BLE001
                code = 99
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 2


def test_metrics_scrape_parses_and_has_the_store_families_and_the_services(sdir):
    cfg = service_config(sdir, metrics={"host": "127.0.0.1", "port": 0})
    with service_thread(cfg) as svc:
        c = connect(svc.socket_path)
        c.put("m/1", b"m" * 4096)
        assert c.get("m/1") == b"m" * 4096
        assert c.ask(p.Lease(0, ["m/1"])).grants[0].status == Status.OK  # one open lease
        text = urllib.request.urlopen(f"http://{svc.metrics_address}/metrics", timeout=10).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        want_store = {f.exposed_name for f in store_families()}
        missing = {n for n in want_store if n not in families and n.removesuffix("_total") not in families}
        assert not missing, missing
        assert set(NODE_FAMILIES) <= set(families)
        hits = {s.labels["tier"]: s.value for s in families["mooncake_kv_tier_hits"].samples
                if s.name.endswith("_total")}
        assert hits["dram"] == 1.0
        tokens = {s.labels["kind"]: s.value for s in families["mooncake_kv_node_tokens"].samples}
        assert tokens == {"reservation": 0.0, "lease": 1.0}
        assert families["mooncake_kv_node_connections"].samples[0].value == 1.0
        frames = {s.labels["op"]: s.value for s in families["mooncake_kv_node_frames"].samples}
        assert frames["reserve"] == 1.0 and frames["lease"] == 2.0
        counts = {s.labels["op"]: s.value for s in families["mooncake_kv_node_op_seconds"].samples
                  if s.name.endswith("_count")}
        assert counts["lease"] == 2.0 and counts["commit"] == 1.0
        c.close()


def test_two_thousand_idle_connections_cost_no_thread_and_little_memory(sdir):
    cfg = service_config(sdir, max_connections=4096, max_connections_per_client=4096)
    svc = ServiceProcess(cfg, sdir)
    conns: list[Raw] = []
    try:
        svc.wait_ready()
        warm = connect(svc.socket_path)
        warm.put("i/1", b"i" * 4096)
        warm.close()
        wait_until(lambda: proc_status(svc.proc.pid)["Threads"])
        before = proc_status(svc.proc.pid)
        for i in range(2000):
            c = Raw(svc.socket_path, timeout_s=30.0)
            assert isinstance(c.hello(want_segment=(i % 100 == 0)), p.Welcome)  # a few map the segment
            conns.append(c)
        after = proc_status(svc.proc.pid)
        assert int(after["Threads"]) == int(before["Threads"]), (before["Threads"], after["Threads"])
        grown_kib = int(after["VmRSS"].split()[0]) - int(before["VmRSS"].split()[0])
        assert grown_kib < 64 * 1024, f"RSS grew {grown_kib} KiB for 2000 idle connections"
        fresh = connect(svc.socket_path)
        assert fresh.get("i/1") == b"i" * 4096
        stats = fresh.ask(p.Stats(0))
        assert stats.node.connections == 2001
        fresh.close()
    finally:
        for c in conns:
            c.close()
        svc.close()


def test_mooncake_kv_serve_runs_the_same_service(sdir):
    cfg = service_config(sdir)
    config_path = os.path.join(sdir, "node.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_kv.cli", "serve", "--config", config_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO))
    try:
        probe = subprocess.run([sys.executable, "-m", "mooncake_kv.cli", "status", "--socket", cfg["socket"],
                                "--json", "--wait", "60"], capture_output=True, text=True, env=env, cwd=str(REPO),
                               timeout=90)
        assert probe.returncode == 0 and json.loads(probe.stdout)["pid"] == proc.pid, probe
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "node service ready" in out and "node service stopped (exit status 0)" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
