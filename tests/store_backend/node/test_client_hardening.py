"""NodeClient against what a hostile review found: slot tokens held across a service restart, a
socket directory or service of another user, a remove longer than the op timeout, waiting calls on
a connection that must carry the awaited commit, and auto-start races (a real service subprocess,
SIGKILL, real sockets)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import threading
import time

import pytest
import yaml

from store_backend.node import protocol as p
from store_backend.node.autostart import ServiceProcess as Starter
from store_backend.node.client import NodeAccessError, NodeClient, probe
from store_backend.types import Status
from tests.store_backend.node.server_harness import (
    Raw,
    ServiceProcess,
    cleanup_dir,
    service_config,
    short_dir,
    wait_until,
)


@pytest.fixture
def restartable():
    """(config, directory, holder): holder[0] is the running ServiceProcess (replace it to restart)."""
    d = short_dir()
    cfg = service_config(d)
    holder = [ServiceProcess(cfg, d)]
    holder[0].wait_ready()
    try:
        yield cfg, d, holder
    finally:
        holder[0].close()
        cleanup_dir(d)


def _restart(cfg, d, holder) -> None:
    holder[0].proc.kill()
    holder[0].wait(10)
    holder[0].close()
    holder[0] = ServiceProcess(cfg, d)
    holder[0].wait_ready()


def _until_ok(call, what: str, timeout_s: float = 10.0):
    end = time.monotonic() + timeout_s
    while True:
        got = call()
        if got.status is Status.OK:
            return got
        assert time.monotonic() < end, f"{what}: {got.status.name}"
        time.sleep(0.1)  # poll interval; the loop has a deadline


def _frames_received(path: str, op: str) -> int:
    """How many ``op`` frames the service has received, asked on a connection of its own (the
    client's pool is left as it is)."""
    raw = Raw(path)
    try:
        assert isinstance(raw.hello(want_segment=False), p.Welcome)
        return raw.ask(p.Stats(0)).node.frames.get(op, 0)
    finally:
        raw.close()


# -- F1: a token from before a restart never names a slot of the new service --------------------------
def test_a_stale_commit_from_before_a_restart_does_not_commit_the_new_reservation(restartable) -> None:
    cfg, d, holder = restartable
    c = NodeClient(cfg["socket"], name="victim", op_timeout_s=10).start()
    try:
        old = c.reserve(["K"], [4096])[0]
        assert old.status is Status.OK
        old.view[:] = b"O" * 4096
        _restart(cfg, d, holder)
        new = _until_ok(lambda: c.reserve(["K"], [4096])[0], "reserve on the new service")
        new.view[:100] = b"N" * 100  # the new writer is half-way
        assert c.commit([old]) == [Status.IO_ERROR]
        buf = bytearray(4096)
        assert c.get_into(["K"], [buf])[0].status is Status.NOT_FOUND  # nothing half-written is visible
        new.view[100:] = b"N" * 3996
        assert c.commit([new]) == [Status.OK]
        r = c.get_into(["K"], [buf])[0]
        assert r.status is Status.OK and bytes(buf) == b"N" * 4096
    finally:
        c.close(flush=False)


def test_a_stale_abort_or_release_from_before_a_restart_leaves_the_new_tokens_alone(restartable) -> None:
    cfg, d, holder = restartable
    c = NodeClient(cfg["socket"], op_timeout_s=10).start()
    try:
        assert c.put(["L"], [b"L" * 4096]) == [Status.OK]
        old_r = c.reserve(["K"], [4096])[0]
        old_l = c.lease(["L"])[0]
        assert old_r.status is Status.OK and old_l.status is Status.OK
        _restart(cfg, d, holder)
        end = time.monotonic() + 10
        while c.put(["L"], [b"l" * 4096]) != [Status.OK]:  # the new service counts its tokens as the old did
            assert time.monotonic() < end
            time.sleep(0.1)  # poll interval; the loop has a deadline
        new_r = _until_ok(lambda: c.reserve(["K"], [4096])[0], "reserve on the new service")
        new_l = _until_ok(lambda: c.lease(["L"])[0], "lease on the new service")
        c.abort([old_r])
        new_r.view[:] = b"N" * 4096
        assert c.commit([new_r]) == [Status.OK]  # the stale abort did not take the new reservation
        assert c.release([old_l]) == [False]  # bytes of the dead service are never "stable"
        assert c.release([new_l]) == [True]  # and the new lease was not ended by the stale release
    finally:
        c.close(flush=False)


def test_token_numbers_differ_between_two_starts_of_a_store() -> None:
    from store_backend.slots import SlotTable
    firsts = {next(SlotTable(1 << 20)._numbers) for _ in range(4)}
    assert len(firsts) == 4  # a restarted service does not count from the same number again


# -- F14: a commit never waits for a connection a waiting call holds (it opens another) -------------
@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("call", ["lease", "exists"])
def test_a_waiting_call_does_not_hold_up_the_commit_it_waits_for(restartable, pool, call) -> None:
    cfg, _d, _holder = restartable
    c = NodeClient(cfg["socket"], max_connections=pool, op_timeout_s=10).start()
    try:
        rs = [c.reserve([f"K{i}"], [4096])[0] for i in range(pool)]  # pending saves of this process
        assert all(r.status is Status.OK for r in rs)
        for r in rs:
            r.view[:] = b"K" * 4096
        out: dict = {}

        def load() -> None:
            t0 = time.monotonic()
            if call == "lease":
                out["got"] = c.lease(["K0"], wait_pending_s=8.0)[0]
            else:
                out["got"] = c.exists(["K0"], wait_s=8.0)
            out["s"] = time.monotonic() - t0

        before = _frames_received(cfg["socket"], call)
        t = threading.Thread(target=load)
        t.start()
        wait_until(lambda: _frames_received(cfg["socket"], call) > before, 10, "the load waiting for K0's commit")
        t0 = time.monotonic()
        assert c.commit([rs[0]]) == [Status.OK]
        commit_s = time.monotonic() - t0
        t.join(15)
        assert not t.is_alive()
        assert commit_s < 3.0, f"the commit waited {commit_s:.1f} s for the waiting call's connection"
        assert out["s"] < 4.0
        if call == "lease":
            assert out["got"].status is Status.OK
            assert bytes(out["got"].view) == b"K" * 4096
            assert c.release([out["got"]]) == [True]
        else:
            assert out["got"] == 1
        c.abort(rs[1:])
        assert c.open_connections <= pool  # the extra connection went away
    finally:
        c.close(flush=False)


# -- F2: the client attaches only to its own user's service, in a directory no one else controls -----
@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_socket_directory_others_can_write_is_refused(restartable, mode) -> None:
    cfg, d, _holder = restartable
    os.chmod(d, mode)
    try:
        with pytest.raises(NodeAccessError, match=rf"{d}.*mode {mode:o}.*chmod 700 {d}"):
            probe(cfg["socket"])
        with pytest.raises(NodeAccessError, match=rf"{d}.*mode {mode:o}"):
            NodeClient(cfg["socket"]).start()
        assert stat.S_IMODE(os.stat(d).st_mode) == mode  # refused, never tightened: left as it is
    finally:
        os.chmod(d, 0o700)
    c = NodeClient(cfg["socket"]).start()  # the same service, once the directory is private again
    c.close(flush=False)


@pytest.mark.parametrize("mode", [0o711, 0o755])
def test_a_socket_directory_others_can_only_pass_or_read_is_tightened_by_the_client(restartable, mode,
                                                                                     caplog) -> None:
    """Nobody else could have put anything in it: the client makes it 0700 (one WARNING line) and
    attaches."""
    cfg, d, _holder = restartable
    os.chmod(d, mode)
    caplog.set_level(logging.WARNING)
    assert probe(cfg["socket"]) is not None
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    c = NodeClient(cfg["socket"]).start()
    c.close(flush=False)
    lines = [r.getMessage() for r in caplog.records if "access away" in r.getMessage()]
    assert lines == [f"socket directory={d}: took group and other access away from the directory "
                     f"(mode {mode:04o} -> 0700)"], lines


def _listen_as(uid: int, path: str) -> tuple[int, int]:
    """A child that binds ``path``, becomes ``uid`` and serves a welcome to whoever says hello (a
    service-like listener of another user). (pid, fd readable once it listens)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only sockets, then _exit
        code = 0
        try:
            os.close(r)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            os.chmod(path, 0o666)
            os.setgid(uid)
            os.setuid(uid)
            srv.listen(4)  # SO_PEERCRED of the connecting side is taken from here
            os.write(w, b"1")
            srv.settimeout(20)
            while True:
                conn, _ = srv.accept()
                conn.settimeout(5)
                try:
                    conn.recv(1 << 16)
                    conn.sendall(p.encode(p.Welcome(1, p.PROTOCOL_VERSION, os.getpid(), 1, "0:0", 1 << 20, 4096,
                                                    8 << 20, 60.0, ["dram"])))
                except OSError:
                    pass
                conn.close()
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    return pid, r


@pytest.mark.skipif(os.getuid() != 0 and not os.environ.get("CI"), reason="needs root to run a listener as another uid")
def test_a_service_run_by_another_user_is_refused() -> None:
    assert os.getuid() == 0, "this test runs as root (CI runs it so)"
    d = short_dir()
    path = os.path.join(d, "node.sock")
    pid, ready = _listen_as(65534, path)
    try:
        assert os.read(ready, 1) == b"1"
        with pytest.raises(NodeAccessError, match=r"served by uid 65534"):
            probe(path)
        with pytest.raises(NodeAccessError, match=r"served by uid 65534"):
            NodeClient(path, connect_timeout_s=3).start()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        cleanup_dir(d)


def test_auto_start_refuses_a_socket_directory_others_can_write(tmp_path) -> None:
    d = short_dir()
    try:
        os.chmod(d, 0o775)
        cfg = service_config(d)
        conf = os.path.join(d, "node.yaml")
        with open(conf, "w") as f:
            yaml.safe_dump(cfg, f)
        starter = Starter(cfg["socket"], conf, start_timeout_s=20)
        with pytest.raises(NodeAccessError, match=rf"{d}.*mode 775"):
            starter.ensure()
        assert not os.path.exists(os.path.join(d, "node.log"))  # nothing spawned
    finally:
        cleanup_dir(d)


def test_auto_start_never_writes_its_log_through_a_symlink() -> None:
    d = short_dir()
    target = os.path.join(short_dir(), "victim-file")
    try:
        with open(target, "w") as f:
            f.write("precious\n")
        os.symlink(target, os.path.join(d, "node.log"))
        cfg = service_config(d)
        conf = os.path.join(d, "node.yaml")
        with open(conf, "w") as f:
            yaml.safe_dump(cfg, f)
        starter = Starter(cfg["socket"], conf, start_timeout_s=20)
        with pytest.raises(NodeAccessError, match="node.log"):
            starter.ensure()
        with open(target) as f:
            assert f.read() == "precious\n"
        assert starter.process is None
    finally:
        cleanup_dir(os.path.dirname(target))
        cleanup_dir(d)


# -- F6: a remove of many keys is sent in batches that each finish within their timeout --------------
def test_a_remove_longer_than_the_op_timeout_answers_what_the_service_removed(monkeypatch) -> None:
    import store_backend.node.client_queries as queries_module
    d = short_dir()
    ssd = {"path": os.path.join(d, "ssd"), "capacity_bytes": 64 << 20, "io_engine": "posix", "backend": "file",
           "admission_policy": "all"}
    cfg = service_config(d, store={"ssd": ssd})
    svc = ServiceProcess(cfg, d)
    try:
        svc.wait_ready()
        c = NodeClient(cfg["socket"], op_timeout_s=0.5).start()
        keys = [f"obj/{i}" for i in range(600)]
        for i in range(0, len(keys), 100):
            assert c.put(keys[i:i + 100], [b"r" * 4096] * 100) == [Status.OK] * 100
        assert c.flush(120)
        monkeypatch.setattr(queries_module, "REMOVE_BATCH_KEYS", 100)
        before = c.service_stats()[1].frames.get("remove", 0)
        t0 = time.monotonic()
        assert c.remove(keys) == [Status.OK] * len(keys)
        took_s = time.monotonic() - t0
        assert c.counters.disconnects == 0
        assert c.service_stats()[1].frames.get("remove", 0) - before == 6  # in frames of at most 100 keys
        assert not any(c.contains(keys))
        print(f"remove of {len(keys)} file-backend keys: {took_s:.1f} s (op_timeout_s 0.5)")
        c.close(flush=False)
    finally:
        svc.close()
        cleanup_dir(d)


# -- F9: a relative config file names the file in the caller's cwd, whatever cwd the service runs in --
def _stop_service_at(path: str) -> None:
    w = probe(path)
    if w is None:
        return
    os.kill(w.service_pid, signal.SIGTERM)
    end = time.monotonic() + 30
    while probe(path) is not None and time.monotonic() < end:
        time.sleep(0.1)  # poll interval; the loop has a deadline


def test_auto_start_with_a_relative_config_file(monkeypatch) -> None:
    d = short_dir()
    cfg = service_config(d)
    try:
        with open(os.path.join(d, "node.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)
        monkeypatch.chdir(d)
        starter = Starter(cfg["socket"], "node.yaml", idle_exit_s=30, start_timeout_s=30)
        try:
            assert starter.ensure() is True
            assert probe(cfg["socket"]) is not None
        finally:
            _stop_service_at(cfg["socket"])
            starter.close()
    finally:
        cleanup_dir(d)


# -- F7: auto-start waits for a process that holds node.lock (a service opening or stopping) ---------
def test_auto_start_waits_while_node_lock_is_held_then_starts() -> None:
    """The holder stands for a service still opening whose starter died, or one in its shutdown
    flush (listener closed, node.lock held): it holds node.lock for 2 s and exits."""
    import subprocess
    import sys
    d = short_dir()
    cfg = service_config(d)
    conf = os.path.join(d, "node.yaml")
    with open(conf, "w") as f:
        yaml.safe_dump(cfg, f)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({os.path.join(d, 'node.lock')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(2)\n")], stdout=subprocess.PIPE, text=True)  # holds node.lock 2 s by design
    starter = Starter(cfg["socket"], conf, idle_exit_s=30, start_timeout_s=30)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        assert starter.ensure() is True
        took_s = time.monotonic() - t0
        assert holder.poll() is not None  # it started once the holder let go
        assert probe(cfg["socket"]) is not None
        print(f"started after {took_s:.1f} s")
    finally:
        holder.kill()
        holder.wait()
        _stop_service_at(cfg["socket"])
        starter.close()
        cleanup_dir(d)


def test_an_owners_waiting_lease_does_not_hold_up_that_owners_commit(restartable) -> None:
    cfg, _d, _holder = restartable
    c = NodeClient(cfg["socket"], op_timeout_s=10).start()
    try:
        [r] = c.reserve(["K"], [4096], owner=7)  # on owner 7's own connection
        r.view[:] = b"K" * 4096
        out: dict = {}
        before = _frames_received(cfg["socket"], "lease")
        t = threading.Thread(target=lambda: out.setdefault("got", c.lease(["K"], wait_pending_s=8.0, owner=7)[0]))
        t.start()
        wait_until(lambda: _frames_received(cfg["socket"], "lease") > before, 10, "the lease waiting for K's commit")
        t0 = time.monotonic()
        assert c.commit([r], owner=7) == [Status.OK]
        commit_s = time.monotonic() - t0
        t.join(15)
        assert commit_s < 3.0, f"the owner's commit waited {commit_s:.1f} s behind its own waiting lease"
        assert out["got"].status is Status.OK and bytes(out["got"].view) == b"K" * 4096
        assert c.reclaim(7) == (0, 1)  # the lease on the extra connection is the owner's too
        assert c.release([out["got"]], owner=7) == [False]
        assert c.service_stats()[1].leases == 0
    finally:
        c.close(flush=False)
