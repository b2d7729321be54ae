"""The node service under hostile or unlucky use: a socket path naming someone's file, a huge key
list on the loop, one client's slow calls against another's stage-ins, a client that never reads,
a busy default metrics port, and status/stop while the service drains."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from store_backend.config_loader import ConfigError
from store_backend.node import protocol as p
from store_backend.node.server import NodeService
from store_backend.types import Status

from .server_harness import REPO, Raw, service_config, service_thread, wait_until


def connect(svc: NodeService, **hello) -> Raw:
    c = Raw(svc.socket_path)
    w = c.hello(**hello)
    assert isinstance(w, p.Welcome), w
    return c


# -- F4: the socket path names a file that is not a socket ----------------------------------------
@pytest.mark.parametrize("kind", ["file", "symlink", "fifo"])
def test_a_socket_path_naming_a_file_that_is_no_socket_is_refused_and_nothing_is_deleted(sdir, kind):
    path = os.path.join(sdir, "results.csv")
    target = os.path.join(sdir, "target.csv")
    if kind == "file":
        with open(path, "w") as f:
            f.write("precious data\n")
    elif kind == "symlink":
        with open(target, "w") as f:
            f.write("precious data\n")
        os.symlink(target, path)
    else:
        os.mkfifo(path, 0o600)
    before = os.lstat(path)
    with pytest.raises(ConfigError) as e:
        NodeService(service_config(sdir, socket=path)).open()
    assert path in str(e.value) and "not a socket" in str(e.value) and str(e.value).startswith("socket:")
    after = os.lstat(path)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    if kind != "fifo":
        with open(path) as f:
            assert f.read() == "precious data\n"
    # The lock was given back: a service on a free path of the same directory starts.
    with service_thread(service_config(sdir)) as svc:
        assert connect(svc).ask(p.Exists(0, ["x"])).n == 0


def test_a_stale_socket_of_a_dead_service_is_still_replaced(sdir):
    path = os.path.join(sdir, "node.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with service_thread(service_config(sdir)) as svc:
        assert connect(svc).ask(p.Exists(0, ["x"])).n == 0


# -- F3: a huge key list does not stall the loop for the other clients ----------------------------
class _Prober(threading.Thread):
    """exists([k]) on a connection of its own every 5 ms; records (start, latency)."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.c = Raw(path, timeout_s=60)
        assert isinstance(self.c.hello(want_segment=False, name="prober"), p.Welcome)
        self.lat: list[tuple[float, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t0 = time.monotonic()
            if not isinstance(self.c.ask(p.Exists(0, ["probe/k"])), p.Count):
                return  # the service is stopping
            self.lat.append((t0, time.monotonic() - t0))
            time.sleep(0.005)  # the prober's pace

    def worst(self, t0: float, t1: float) -> float:
        return max((lat for s, lat in self.lat if s + lat >= t0 and s <= t1), default=0.0)

    def close(self) -> None:
        self.halt.set()
        self.join(70)
        self.c.close()


def test_a_60000_key_lease_with_a_pending_wait_does_not_stall_another_clients_exists(sdir):
    from .server_harness import ServiceProcess

    cfg = service_config(sdir, store={"dram": {"capacity_bytes": 64 << 20,
                                               "shm_name": f"mkn-test-f3-{os.getpid()}"}})
    proc = ServiceProcess(cfg, sdir)
    try:
        proc.wait_ready()
        probe = _Prober(cfg["socket"])
        probe.start()
        a = Raw(cfg["socket"], timeout_s=120)
        assert isinstance(a.hello(want_segment=False, name="A"), p.Welcome)
        w = a.ask(p.Reserve(0, ["pend/0"], [4096])).grants[0]  # one key really pending
        wait_until(lambda: len(probe.lat) >= 150, 30, "150 baseline probes")
        baseline = probe.worst(0.0, time.monotonic())
        keys = [f"k/{i}" for i in range(60_000)] + ["pend/0"]
        for msg in (p.Lease(0, keys, 60.0, True, 0.5), p.Contains(0, keys), p.Pin(0, keys, 30.0),
                    p.Commit(0, list(range(10_000, 70_000))), p.Exists(0, keys, wait_s=0.3)):
            t0 = time.monotonic()
            reply = a.ask(msg)
            t1 = time.monotonic()
            assert not isinstance(reply, p.Error), reply
            # Every probe begun before t1 is recorded once one begun after it is (they run in turn).
            wait_until(lambda: probe.lat[-1][0] > t1, 30, "a probe begun after the call")
            worst = probe.worst(t0, t1)
            op = type(msg).__struct_config__.tag
            # B's exists is answered while A's call runs: bounded, far below what a stalled loop
            # costs (seconds for the lease on the code that scanned per key on the loop).
            assert worst < max(1.0, 10 * baseline), (op, worst, baseline, t1 - t0)
            if isinstance(msg, p.Lease):
                assert t1 - t0 >= 0.45  # it did wait for the pending key
                assert [g.status for g in reply.grants[-2:]] == [Status.NOT_FOUND, Status.NOT_FOUND]
        assert a.ask(p.Commit(0, [w.token])).values == [Status.OK]
        probe.close()
        a.close()
    finally:
        proc.close()


# -- F13: a draining service still answers status, stats and stop ----------------------------------
def test_status_and_stop_reach_a_draining_service_and_a_second_stop_skips_the_drain(sdir, capsys):
    import json
    import signal as _signal

    from store_backend.node import __main__ as cli

    from .server_harness import ServiceProcess

    cfg = service_config(sdir, drain_timeout_s=30.0)
    sock = cfg["socket"]
    proc = ServiceProcess(cfg, sdir)
    holder = None
    try:
        proc.wait_ready()
        holder = Raw(sock, timeout_s=30)
        assert isinstance(holder.hello(want_segment=False, name="holder"), p.Welcome)
        assert holder.ask(p.Reserve(0, ["d/1"], [4096])).grants[0].status == Status.OK  # keeps the drain going
        proc.signal(_signal.SIGTERM)
        assert isinstance(holder.read(), p.Draining)
        capsys.readouterr()
        assert cli.main(["status", "--socket", sock, "--json"]) == 4  # draining
        doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert doc["draining"] is True and doc["ready"] is False and doc["pid"] == proc.proc.pid
        assert doc["reservations"] == 1
        assert cli.main(["status", "--socket", sock]) == 4  # draining
        assert "draining" in capsys.readouterr().out
        # A newcomer is welcomed, told the service drains, refused new tokens, and served the rest.
        late = Raw(sock, timeout_s=10)
        assert isinstance(late.hello(want_segment=False, name="late"), p.Welcome)
        push = late.read()
        assert isinstance(push, p.Draining) and 0 < push.deadline_s <= 30.0
        refused = late.ask(p.Reserve(0, ["d/2"], [4096]))
        assert isinstance(refused, p.Error) and refused.code == "closed"
        assert late.ask(p.Exists(0, ["d/1"], count_reserved=True)).n == 1
        stats = late.ask(p.Stats(0))
        assert isinstance(stats, p.StatsReply) and stats.node.draining is True
        late.close()
        assert proc.proc.poll() is None  # still draining: the reservation is open
        t0 = time.monotonic()
        assert cli.main(["stop", "--socket", sock, "--wait", "20"]) == 0  # skips the 30 s drain
        assert time.monotonic() - t0 < 15.0
        assert proc.wait(10) in (0, 1)  # 1 when the skipped wait beat the store's close (documented)
        assert "skipping the waits" in proc.log_text()
        assert not os.path.exists(sock)
        assert cli.main(["status", "--socket", sock, "--json"]) == cli.NOT_ANSWERING
    finally:
        if holder is not None:
            holder.close()
        proc.close()


# -- F8: a client that sends requests and reads no reply is disconnected --------------------------
def test_a_client_that_pipelines_requests_and_never_reads_is_closed_after_send_timeout_s(sdir):
    cfg = service_config(sdir, send_timeout_s=1.0, idle_timeout_s=2.0, frame_timeout_s=2.0)
    with service_thread(cfg) as svc:
        other = connect(svc, name="other")
        flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            flood.connect(svc.socket_path)
            flood.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION, os.getpid(), "flood", False)))
            wait_until(lambda: "flood" in {c.name for c in svc.node_stats().clients}, what="flood's hello")
            assert other.ask(p.Reserve(0, ["held/1"], [4096])).grants[0].status == Status.OK
            flood.setblocking(False)
            blob = p.encode(p.Contains(2, [f"k{i}" for i in range(20_000)])) * 200
            sent, t0, gone = 0, time.monotonic(), False
            while time.monotonic() - t0 < 5 and sent < len(blob):
                try:
                    sent += flood.send(blob[sent:sent + (1 << 20)])
                except BlockingIOError:
                    time.sleep(0.05)  # the service stopped reading: it is stuck sending replies
                except (BrokenPipeError, ConnectionResetError):
                    gone = True
                    break
            assert gone or sent < len(blob)  # the replies filled the socket: its sends block
            # Well past send_timeout_s, and idle_timeout_s never applies (the service is not reading).
            wait_until(lambda: "flood" not in {c.name for c in svc.node_stats().clients}, timeout_s=15.0,
                       what="the flooding connection closed")
            assert svc.send_timeouts >= 1
            # The other client, holding a reservation, is still served.
            assert other.ask(p.Exists(0, ["held/1"], count_reserved=True)).n == 1
        finally:
            flood.close()
            other.close()


def test_send_timeout_s_must_be_positive(sdir):
    with pytest.raises(ConfigError) as e:
        NodeService(service_config(sdir, send_timeout_s=0))
    assert "send_timeout_s" in str(e.value)


# -- F11: the default metrics port is per host, the service per user ------------------------------
@pytest.fixture
def busy_default_metrics_port():
    """127.0.0.1:9464 listened on (by this test, or by whoever has it already)."""
    from store_backend.node.config import DEFAULT_METRICS_PORT

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", DEFAULT_METRICS_PORT))
        holder.listen(1)
    except OSError:
        holder.close()
        holder = None  # another process has it: busy all the same
    yield DEFAULT_METRICS_PORT
    if holder is not None:
        holder.close()


def test_a_busy_default_metrics_port_turns_metrics_off_with_a_warning_and_status_says_so(
        sdir, busy_default_metrics_port, caplog, capsys):
    import json

    from store_backend.node import __main__ as cli

    caplog.set_level("WARNING", logger="store_backend.node.server")
    with service_thread(service_config(sdir, metrics={})) as svc:  # the default port
        assert svc.metrics_address == ""
        off = svc.node_stats().metrics_off
        assert str(busy_default_metrics_port) in off and "metrics.port" in off
        assert any("/metrics is off" in r.getMessage() for r in caplog.records)
        capsys.readouterr()
        assert cli.main(["status", "--socket", svc.socket_path, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert doc["ready"] is True and doc["metrics"] == "" and doc["metrics_off"] == off
        assert cli.main(["status", "--socket", svc.socket_path]) == 0
        assert "off (" in capsys.readouterr().out


def test_a_busy_metrics_port_named_in_the_config_stops_the_start(sdir, busy_default_metrics_port):
    with pytest.raises(ConfigError) as e:
        NodeService(service_config(sdir, metrics={"port": busy_default_metrics_port})).open()
    assert str(e.value).startswith("metrics.port:") and str(busy_default_metrics_port) in str(e.value)
    # Nothing was left behind: a service with metrics on a free port starts in the same directory.
    with service_thread(service_config(sdir, metrics={"port": 0})) as svc:
        assert svc.metrics_address.startswith("127.0.0.1:") and svc.node_stats().metrics_off == ""


# -- F5: one client's slow bulk calls leave threads for others' loads and calls -------------------
def test_one_clients_slow_flushes_do_not_starve_stage_in_leases_or_other_clients_calls(sdir, monkeypatch):
    ssd = {"path": os.path.join(sdir, "ssd"), "capacity_bytes": 64 << 20, "io_engine": "posix",
           "backend": "file"}
    cfg = service_config(sdir, workers=4, store={"ssd": ssd})
    with service_thread(cfg) as svc:
        release = threading.Event()
        started = []
        real = svc.store.flush_report

        def slow_flush(timeout_s=None):  # fault injection: a flush that takes long
            started.append(time.monotonic())
            release.wait(20)
            return real(timeout_s)

        monkeypatch.setattr(svc.store, "flush_report", slow_flush)
        greedy = [connect(svc, name=f"greedy-{i}") for i in range(4)]  # one process, four connections
        b = connect(svc, name="loader")
        try:
            for g in greedy:
                g.sock.sendall(p.encode(p.Flush(7, None)))
            wait_until(lambda: len(started) >= 2, what="two flushes running")
            time.sleep(0.3)  # the window in which a third flush must not start
            # One process (and one kind of call) holds at most half of the 4 bulk threads.
            assert len(started) == 2
            t0 = time.monotonic()
            # A lease with an SSD below goes to the pool (it may stage in): the load lane answers it.
            got = b.ask(p.Lease(0, ["only/ssd"], 30.0, True, 0.0))
            assert isinstance(got, p.Slots) and got.grants[0].status == Status.NOT_FOUND
            assert time.monotonic() - t0 < 3.0
            # Another process's bulk call gets one of the threads the greedy one may not take.
            script = ("import sys, time; from tests.store_backend.node.server_harness import Raw; "
                      "from store_backend.node import protocol as p; c = Raw(sys.argv[1], timeout_s=15); "
                      "c.hello(want_segment=False, name='other'); t0 = time.monotonic(); "
                      "r = c.ask(p.Remove(0, ['gone/1'])); "
                      "print([int(v) for v in r.values], time.monotonic() - t0)")
            out = subprocess.run([sys.executable, "-c", script, svc.socket_path], capture_output=True, text=True,
                                 timeout=60, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
            assert out.returncode == 0, out.stderr
            values, took_s = out.stdout.split("]")
            assert values.strip("[ ") == str(int(Status.NOT_FOUND)) and float(took_s) < 3.0, out.stdout
            release.set()
            for g in greedy:
                reply = g.read(30)
                assert isinstance(reply, p.FlushResult) and reply.id == 7, reply
            assert len(started) == 4  # the waiting ones ran once threads were free
        finally:
            release.set()
            for g in greedy:
                g.close()
            b.close()


def test_a_bad_room_wait_is_refused_before_any_slot_is_granted(sdir):
    """A reserve whose room_wait_s is out of range gets error(bad_request) naming it, and holds
    nothing: the check comes before the first key is granted, not only when one waits."""
    with service_thread(service_config(sdir)) as svc:
        c = connect(svc)
        for bad in (-1.0, float("inf"), 1e9):
            reply = c.ask(p.Reserve(0, ["rw/a", "rw/b"], [4096, 4096], None, 5.0, bad))
            assert isinstance(reply, p.Error) and reply.code == "bad_request" and "room_wait_s" in reply.message, reply
        assert svc.store.stats().slots.reservations == 0 and svc.store.stats().slots.held_bytes == 0
        good = c.ask(p.Reserve(0, ["rw/a"], [4096], None, 5.0, 0.5))
        assert isinstance(good, p.Slots) and good.grants[0].status == Status.OK
