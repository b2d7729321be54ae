"""The node service on a thread of the test process, spoken to in raw frames: the segment passed with
welcome, bytes written through a reservation read back through a lease on another connection,
visibility until commit, slots kept for the process when a connection ends and reclaimed when the
process is killed mid-copy or forgets them, another process's tokens, access checks, the lock,
connection limits and broken frames."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from store_backend.config_loader import ConfigError
from store_backend.framing import LEN
from store_backend.node import protocol as p
from store_backend.node.client import NodeAccessError, probe
from store_backend.node.fdpass import fd_identity
from store_backend.node.server import NodeService
from store_backend.private import NotPrivateError
from store_backend.store import TieredStore
from store_backend.types import Status

from .server_harness import (
    REPO,
    OtherProcess,
    Raw,
    service_config,
    service_thread,
    throwaway_uid,
    wait_until,
)

# Acting as another user needs root (CI runs as root; there a skip fails the run: tests/conftest.py).
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def svc(sdir):
    with service_thread(service_config(sdir)) as s:
        yield s


def connect(svc: NodeService, **hello) -> Raw:
    c = Raw(svc.socket_path)
    w = c.hello(**hello)
    assert isinstance(w, p.Welcome), w
    return c


def held(svc: NodeService) -> tuple[int, int, int]:
    """(service-side tokens, service-side held bytes, store-side held bytes)."""
    n = svc.node_stats()
    s = svc.store.stats() if svc.store is not None else None
    return n.reservations + n.leases, n.held_bytes, (s.slots.held_bytes if s is not None else 0)


def test_welcome_passes_the_segment_and_a_second_connection_reads_what_the_first_wrote(svc):
    a = connect(svc, name="writer")
    b = connect(svc, name="reader")
    try:
        assert a.fd is not None and fd_identity(a.fd) == a.welcome.segment_id == svc.node_stats().segment_id
        st = os.fstat(a.fd)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert a.welcome.segment_bytes == 16 << 20 and a.welcome.conn_id != b.welcome.conn_id
        assert a.welcome.service_pid == os.getpid() and a.welcome.tiers == ["dram"]
        data = os.urandom(100_000)
        a.put("k/1", data)
        assert b.get("k/1") == data
        assert b.ask(p.Exists(0, ["k/1", "k/2"])).n == 1
        assert b.ask(p.SizeOf(0, ["k/1", "k/2"])).values == [len(data), None]
        assert b.ask(p.TierOf(0, ["k/1", "k/2"])).values == ["dram", None]
        assert b.ask(p.Contains(0, ["k/1"])).values == [True]
        assert b.ask(p.Pin(0, ["k/1", "k/2"], 5.0)).values == [True, False]
        assert isinstance(b.ask(p.Unpin(0, ["k/1"])), p.Ack)
        assert b.ask(p.ExistsAll(0, [["k/1"], ["k/1", "k/2"]])).n == 1
        assert b.ask(p.Keys(0, prefix="k/")).keys == ["k/1"]
        assert b.ask(p.Flush(0, 1.0)).ok
        stats = b.ask(p.Stats(0))
        assert isinstance(stats, p.StatsReply) and stats.node.connections == 2
        assert {c.name for c in stats.node.clients} == {"writer", "reader"}
        assert stats.node.frames["reserve"] == 1 and stats.node.frames["lease"] == 1
        assert b.ask(p.Remove(0, ["k/1"])).values == [Status.OK]
        assert b.get("k/1") is None
        assert held(svc) == (0, 0, 0)
    finally:
        a.close()
        b.close()


def test_hello_without_segment_sends_no_fd_and_status_probes_work(svc):
    c = Raw(svc.socket_path)
    try:
        assert isinstance(c.hello(want_segment=False), p.Welcome) and c.fd is None
    finally:
        c.close()


def test_reserved_key_is_invisible_to_another_connection_until_committed(svc):
    a, b = connect(svc), connect(svc)
    try:
        slots = a.ask(p.Reserve(0, ["r/1"], [4096]))
        g = slots.grants[0]
        assert g.status == Status.OK
        a.mapping[g.offset:g.offset + 4096] = b"x" * 4096
        assert b.ask(p.Exists(0, ["r/1"])).n == 0
        assert b.ask(p.Contains(0, ["r/1"])).values == [False]
        assert b.ask(p.Lease(0, ["r/1"])).grants[0].status == Status.NOT_FOUND
        assert b.ask(p.Exists(0, ["r/1"], count_reserved=True)).n == 1
        assert b.ask(p.Reserve(0, ["r/1"], [4096])).grants[0].status == Status.EXISTS
        assert a.ask(p.Commit(0, [g.token])).values == [Status.OK]
        assert b.ask(p.Exists(0, ["r/1"])).n == 1
        assert b.get("r/1") == b"x" * 4096
    finally:
        a.close()
        b.close()


def test_exists_with_wait_answers_when_another_connection_commits(svc):
    a, b = connect(svc), connect(svc)
    try:
        g = a.ask(p.Reserve(0, ["w/1"], [4096])).grants[0]
        received = svc.frames["exists"]
        b.sock.sendall(p.encode(p.Exists(77, ["w/1"], wait_s=10.0)))
        wait_until(lambda: svc.frames["exists"] > received, what="b's exists waiting")
        t0 = time.monotonic()
        assert a.ask(p.Commit(0, [g.token])).values == [Status.OK]
        reply = b.read()
        assert isinstance(reply, p.Count) and reply.id == 77 and reply.n == 1
        assert time.monotonic() - t0 < 5.0
        # The loop kept serving while the wait ran on the pool (the commit above was answered).
    finally:
        a.close()
        b.close()


def test_tokens_of_another_process_answer_io_error_and_change_nothing_and_any_own_connection_ends_them(svc):
    a, b = connect(svc), connect(svc)
    other = OtherProcess(svc.socket_path)
    try:
        r = a.ask(p.Reserve(0, ["t/1"], [4096])).grants[0]
        a.put("t/2", b"y" * 100)
        ls = a.ask(p.Lease(0, ["t/2"])).grants[0]
        r2 = a.ask(p.Reserve(0, ["t/3"], [4096])).grants[0]
        assert other.run(f"[int(v) for v in c.ask(p.Commit(0, [{r.token}, 999999])).values]") == [9, 9]
        assert other.run(f"type(c.ask(p.Abort(0, [{r.token}]))).__name__") == "Ack"
        assert other.run(f"c.ask(p.Release(0, [{ls.token}])).values") == [False]
        assert other.run(f"c.ask(p.Forget(0, [{a.welcome.conn_id}])).n") == 0  # not its connection
        assert held(svc)[0] == 3
        # The process's own connections: any of them ends a token whichever took it.
        assert b.ask(p.Commit(0, [r.token])).values == [Status.OK]
        assert b.ask(p.Release(0, [ls.token])).values == [True]
        assert a.ask(p.Commit(0, [r2.token])).values == [Status.OK]
        assert b.ask(p.Release(0, [ls.token])).values == [False]  # ended already
        assert held(svc) == (0, 0, 0)
    finally:
        other.kill()
        a.close()
        b.close()


def test_a_lost_connection_leaves_its_slots_to_the_process_until_it_forgets_them(svc):
    a, b = connect(svc), connect(svc)
    try:
        b.put("c/lease", b"l" * 8192)
        g = a.ask(p.Reserve(0, ["c/1"], [1 << 20])).grants[0]
        a.mapping[g.offset:g.offset + 1000] = b"h" * 1000  # half written
        lease = a.ask(p.Lease(0, ["c/lease"])).grants[0]
        lost = a.ask(p.Reserve(0, ["c/2"], [4096])).grants[0]  # a grant the client "never read"
        assert lease.status == Status.OK and lost.status == Status.OK
        assert held(svc)[1] == (1 << 20) + 8192 + 4096
        a.sock.close()  # the connection is gone, the process is not: a thread may still be copying
        wait_until(lambda: svc.node_stats().connections == 1, what="the connection ended")
        assert held(svc)[1] == (1 << 20) + 8192 + 4096 and svc.node_stats().orphaned == 3
        assert b.ask(p.Exists(0, ["c/1"], count_reserved=True)).n == 1  # still being written
        # The process forgets the lost connection, keeping what it handed out (the reservation).
        assert b.ask(p.Forget(0, [a.welcome.conn_id], keep=[g.token])).n == 2
        assert held(svc)[1] == 1 << 20
        b.mapping[g.offset + 1000:g.offset + (1 << 20)] = b"h" * ((1 << 20) - 1000)  # the copy finishes
        assert b.ask(p.Commit(0, [g.token])).values == [Status.OK]
        assert b.get("c/1") == b"h" * (1 << 20)
        assert b.ask(p.Exists(0, ["c/2"], count_reserved=True)).n == 0
        assert held(svc) == (0, 0, 0)
    finally:
        a.close()
        b.close()


def test_forget_of_a_connection_still_open_closes_it_first(svc):
    a, b = connect(svc), connect(svc)
    try:
        g = a.ask(p.Reserve(0, ["fo/1"], [4096])).grants[0]
        assert b.ask(p.Forget(0, [a.welcome.conn_id])).n == 1
        assert a.closed_by_peer()
        assert held(svc) == (0, 0, 0)
        assert b.ask(p.Commit(0, [g.token])).values == [Status.IO_ERROR]
    finally:
        a.close()
        b.close()


_COPYING_CLIENT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from store_backend.node import protocol as p
    from tests.store_backend.node.server_harness import Raw
    c = Raw({path!r})
    c.hello(name="copier")
    if {mode!r} == "write":
        g = c.ask(p.Reserve(0, ["kill/1"], [4 << 20])).grants[0]
    else:
        g = c.ask(p.Lease(0, ["kill/read"])).grants[0]
    assert g.status == 0, g
    print("copying", flush=True)
    chunk = b"z" * 65536
    while True:  # copying into (or out of) the slot until killed
        for off in range(0, g.nbytes - 65536, 65536):
            if {mode!r} == "write":
                c.mapping[g.offset + off:g.offset + off + 65536] = chunk
            else:
                bytes(c.mapping[g.offset + off:g.offset + off + 65536])
""")


@pytest.mark.parametrize("mode", ["write", "read"])
def test_a_client_killed_mid_copy_is_reclaimed_and_others_keep_being_served(svc, mode):
    b = connect(svc)
    try:
        b.put("kill/read", os.urandom(1 << 20))
        script = _COPYING_CLIENT.format(repo=str(REPO), path=svc.socket_path, mode=mode)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        try:
            assert child.stdout.readline().strip() == "copying"
            assert held(svc)[0] == 1
            child.kill()
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
        wait_until(lambda: held(svc) == (0, 0, 0), what="the killed client's slot reclaimed")
        assert b.ask(p.Exists(0, ["kill/1"], count_reserved=True)).n == 0
        fresh = os.urandom(4 << 20)
        b.put("kill/1", fresh)
        assert b.get("kill/1") == fresh
    finally:
        b.close()


def test_the_peer_process_exiting_reclaims_even_while_a_forked_child_keeps_the_socket(svc):
    """The client forks a child that inherits the connection and outlives it: no end of stream
    reaches the service, the pidfd of the client does."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from store_backend.node import protocol as p
        from tests.store_backend.node.server_harness import Raw
        c = Raw({svc.socket_path!r})
        c.hello(name="forker")
        g = c.ask(p.Reserve(0, ["fork/1"], [65536])).grants[0]
        assert g.status == 0
        if os.fork() == 0:
            time.sleep(30)  # holds the socket open
            os._exit(0)
        print("reserved", flush=True)
        time.sleep(30)  # lives on until the test kills it
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "reserved"
        assert held(svc)[0] == 1
        child.kill()
        child.wait(10)
        wait_until(lambda: held(svc) == (0, 0, 0), what="reclaimed through the pidfd")
        assert svc.pid_exits >= 1
    finally:
        try:
            os.killpg(child.pid, 9)  # the grandchild too
        except ProcessLookupError:
            pass


def test_a_socket_directory_wider_than_0700_is_tightened_with_one_log_line(sdir, caplog):
    """A directory of this user that group and others may only read or pass through cannot hold
    anything they planted: the service takes their access away (0700), says so in one WARNING
    line, and starts. One the service makes is 0700, its socket 0600."""
    caplog.set_level(logging.WARNING)
    for mode in (0o755, 0o711):
        wide = os.path.join(sdir, f"wide{mode:o}")
        os.mkdir(wide, 0o700)
        os.chmod(wide, mode)
        with service_thread(service_config(wide)):
            assert stat.S_IMODE(os.stat(wide).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(os.path.join(wide, "node.sock")).st_mode) == 0o600
        lines = [r.getMessage() for r in caplog.records if "access away" in r.getMessage() and wide in r.getMessage()]
        assert lines == [f"socket directory={wide}: took group and other access away from the directory "
                         f"(mode {mode:04o} -> 0700)"], lines
    made = os.path.join(sdir, "made")
    with service_thread(service_config(made)):
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(made, "node.sock")).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_socket_directory_others_may_write_is_refused_and_left_alone(sdir, mode):
    """Someone else could have planted a socket, a lock or a config in it: refused (taking the
    write bit away now would bless what is there), naming the path, owner, mode and the fix."""
    d = os.path.join(sdir, "open")
    os.mkdir(d, 0o700)
    os.chmod(d, mode)
    with pytest.raises(NotPrivateError) as e:
        NodeService(service_config(d)).open()
    msg = str(e.value)
    assert d in msg and f"owner uid {os.geteuid()}" in msg and f"mode {stat.S_IMODE(mode):04o}" in msg, msg
    assert f"chmod -R go-rwx {d}" in msg, msg
    assert stat.S_IMODE(os.stat(d).st_mode) == mode and os.listdir(d) == []


def test_a_socket_directory_that_is_a_link_or_holds_a_file_others_may_write_is_refused(sdir):
    real = os.path.join(sdir, "real")
    os.mkdir(real, 0o700)
    link = os.path.join(sdir, "link")
    os.symlink(real, link)
    with pytest.raises(ConfigError, match=rf"{link} is not a directory \(a symbolic link, owner uid {os.geteuid()}"):
        NodeService(service_config(link)).open()
    # Others could pass through the directory until now, and may write a file in it: they could
    # have changed that file (a config an auto-start would run).
    os.chmod(real, 0o755)
    planted = os.path.join(real, "autostart-config.json")
    with open(planted, "w") as f:
        f.write("{}")
    os.chmod(planted, 0o666)
    with pytest.raises(NotPrivateError) as e:
        NodeService(service_config(real)).open()
    msg = str(e.value)
    assert planted in msg and "mode 0666" in msg and "remove it" in msg, msg
    assert not os.path.exists(os.path.join(real, "node.sock"))


@as_root
def test_a_socket_directory_of_another_user_or_holding_another_users_socket_is_refused(sdir):
    """Another user's directory is refused (that user can serve or replace the socket), and so is
    a socket file another user made in a directory of ours: neither the service (which would take
    its place) nor a client (before it connects) trusts it."""
    uid = throwaway_uid()
    other = os.path.join(sdir, "other")
    os.mkdir(other, 0o700)
    os.chown(other, uid, uid)
    with pytest.raises(NotPrivateError) as e:
        NodeService(service_config(other)).open()
    msg = str(e.value)
    assert other in msg and f"owned by uid {uid}" in msg and "mode 0700" in msg and f"chown -R {os.geteuid()}" in msg
    assert os.listdir(other) == []
    mine = os.path.join(sdir, "mine")
    os.mkdir(mine, 0o700)
    path = os.path.join(mine, "node.sock")
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        planted.bind(path)
        planted.listen(1)
        os.chown(path, uid, uid)
        with pytest.raises(NotPrivateError) as e:
            NodeService(service_config(mine)).open()
        msg = str(e.value)
        assert path in msg and f"owned by uid {uid}" in msg and "remove it" in msg, msg
        assert os.stat(path).st_uid == uid  # left as it was
        with pytest.raises(NodeAccessError, match=rf"{path} is owned by uid {uid}"):
            probe(path, timeout_s=2.0)
    finally:
        planted.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_a_process_of_another_uid_gets_error_permission(svc, sdir):
    # Open the path up after start (as a careless admin might), so the kernel lets the other user
    # connect and the service's own SO_PEERCRED check is what refuses it.
    os.chmod(sdir, 0o711)
    os.chmod(svc.socket_path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only os/socket calls until _exit
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(svc.socket_path)
            got = b""
            while True:
                piece = s.recv(65536)
                if not piece:
                    break
                got += piece
            os.write(w, got)
        except BaseException as e:  # noqa: BLE001
            os.write(w, repr(e).encode())
        os._exit(0)
    os.close(w)
    out = b""
    while piece := os.read(r, 65536):
        out += piece
    os.close(r)
    os.waitpid(pid, 0)
    (n,) = LEN.unpack(out[:4])
    reply = p.MessageDecoder(p.Reply).decode(out[4:4 + n])
    assert isinstance(reply, p.Error) and reply.code == "permission", out
    assert "uid 65534 may not attach" in reply.message and svc.socket_path in reply.message
    assert svc.refused["permission"] == 1


def test_a_second_service_is_refused_by_the_lock(svc, sdir):
    cfg = service_config(sdir)
    with pytest.raises(ConfigError, match=r"another node service \(pid \d+\) holds .*node.lock"):
        NodeService(cfg).open()
    c = connect(svc)  # the first one is unharmed
    c.close()


def test_past_max_connections_a_newcomer_gets_error_busy(sdir):
    with service_thread(service_config(sdir, max_connections=2)) as svc:
        a, b = connect(svc), connect(svc)
        try:
            c = Raw(svc.socket_path)
            reply = c.read()
            assert isinstance(reply, p.Error) and reply.code == "busy"
            assert c.closed_by_peer()
            c.close()
            a.close()
            wait_until(lambda: svc.node_stats().connections == 1)
            d = connect(svc)
            d.close()
        finally:
            a.close()
            b.close()


def test_broken_frames_get_an_error_and_a_disconnect(svc):
    cases = [
        (LEN.pack(64 << 20), "too_large"),  # over the cap: refused at its header
        (LEN.pack(3) + b"\xc1\xc1\xc1", "bad_request"),  # not msgpack
        (p.encode(p.Count(1, 2)), "bad_request"),  # a reply is no request
    ]
    for data, code in cases:
        c = Raw(svc.socket_path)
        c.sock.sendall(data)
        reply = c.read()
        assert isinstance(reply, p.Error) and reply.code == code, (data, reply)
        assert c.closed_by_peer()
        c.close()
    c = Raw(svc.socket_path)  # a request before hello
    c.sock.sendall(p.encode(p.Exists(1, ["k"])))
    reply = c.read()
    assert isinstance(reply, p.Error) and "first frame must be hello" in reply.message
    assert c.closed_by_peer()
    c.close()
    c = Raw(svc.socket_path)
    reply = c.hello(want_segment=False, version=p.PROTOCOL_VERSION + 1)
    assert isinstance(reply, p.Error) and reply.code == "version"
    assert c.closed_by_peer()
    c.close()
    ok = connect(svc)
    bad = ok.ask(p.Pin(0, ["k"], -1.0))  # a bad value is an error on an open connection
    assert isinstance(bad, p.Error) and bad.code == "bad_request" and "ttl_s" in bad.message
    assert ok.ask(p.Exists(0, ["k"])).n == 0
    ok.close()
    assert svc.bad_frames >= 4


def test_a_frame_must_complete_in_time_and_idle_connections_without_tokens_close(sdir):
    cfg = service_config(sdir, frame_timeout_s=0.3, idle_timeout_s=0.5)
    with service_thread(cfg) as svc:
        slow = connect(svc)
        slow.sock.sendall(LEN.pack(100) + b"\x00")  # then nothing
        reply = slow.read(5.0)
        assert isinstance(reply, p.Error) and "did not complete within 0.3 s" in reply.message
        assert slow.closed_by_peer()
        slow.close()
        idle = connect(svc)
        holder = connect(svc)
        assert holder.ask(p.Reserve(0, ["idle/1"], [4096])).grants[0].status == Status.OK
        assert idle.closed_by_peer(timeout_s=5.0)
        time.sleep(0.7)  # past idle_timeout_s: the holder (it holds a token) must not be closed meanwhile
        assert holder.ask(p.Exists(0, ["idle/1"], count_reserved=True)).n == 1  # still served
        assert svc.idle_closed >= 1
        idle.close()
        holder.close()


def test_draining_refuses_new_slots_lets_open_ones_finish_and_pushes_draining(sdir):
    cfg = service_config(sdir, drain_timeout_s=10.0)
    svc = NodeService(cfg).run_in_thread()
    a, b = connect(svc), connect(svc)
    try:
        g = a.ask(p.Reserve(0, ["d/1"], [4096])).grants[0]
        t0 = time.monotonic()
        svc.stop()
        push = a.read()
        assert isinstance(push, p.Draining) and push.id == 0 and push.deadline_s == 10.0
        assert isinstance(b.read(), p.Draining)
        refused = b.ask(p.Reserve(0, ["d/2"], [4096]))
        assert isinstance(refused, p.Error) and refused.code == "closed"
        refused = b.ask(p.Lease(0, ["d/1"]))
        assert isinstance(refused, p.Error) and refused.code == "closed"
        assert b.ask(p.Exists(0, ["d/1"], count_reserved=True)).n == 1  # other calls still answered
        assert a.ask(p.Commit(0, [g.token])).values == [Status.OK]
        assert svc.stop(timeout_s=20) == 0
        assert time.monotonic() - t0 < 8.0  # it did not wait out the drain once no token was open
        assert a.closed_by_peer() and b.closed_by_peer()
        assert not os.path.exists(svc.socket_path)
    finally:
        a.close()
        b.close()
        svc.stop(skip_waits=True, timeout_s=10)


def test_a_lease_waits_for_a_pending_commit_on_the_loop_and_an_abort_ends_the_wait(svc):
    a, b = connect(svc), connect(svc)
    try:
        g = a.ask(p.Reserve(0, ["p/1", "p/2"], [4096, 4096])).grants
        a.mapping[g[0].offset:g[0].offset + 4096] = b"q" * 4096
        received = svc.frames["lease"]
        b.sock.sendall(p.encode(p.Lease(50, ["p/1"], wait_pending_s=30.0)))
        wait_until(lambda: svc.frames["lease"] > received, what="b's lease waiting")
        assert a.ask(p.Commit(0, [g[0].token])).values == [Status.OK]  # served while b waits
        reply = b.read()
        assert isinstance(reply, p.Slots) and reply.id == 50 and reply.grants[0].status == Status.OK
        assert bytes(b.mapping[reply.grants[0].offset:reply.grants[0].offset + 4096]) == b"q" * 4096
        assert b.ask(p.Release(0, [reply.grants[0].token])).values == [True]
        t0 = time.monotonic()
        received = svc.frames["lease"]
        b.sock.sendall(p.encode(p.Lease(51, ["p/2"], wait_pending_s=30.0)))
        wait_until(lambda: svc.frames["lease"] > received, what="b's lease waiting")
        assert isinstance(a.ask(p.Abort(0, [g[1].token])), p.Ack)
        reply = b.read()
        assert reply.id == 51 and reply.grants[0].status == Status.NOT_FOUND
        assert time.monotonic() - t0 < 5.0
    finally:
        a.close()
        b.close()


def test_waits_hold_no_pool_thread_and_end_with_their_connection(sdir):
    """More waiting clients than pool threads: the pool still serves a blocking call at once."""
    with service_thread(service_config(sdir, workers=1)) as svc:
        waiters = [connect(svc) for _ in range(4)]
        other = connect(svc)
        try:
            received = svc.frames["exists"]
            for i, w in enumerate(waiters):
                w.sock.sendall(p.encode(p.Exists(1, [f"never/{i}"], wait_s=3600.0)))
            wait_until(lambda: svc.frames["exists"] >= received + len(waiters), what="every waiter waiting")
            t0 = time.monotonic()
            assert other.ask(p.Remove(0, ["never/x"])).values == [Status.NOT_FOUND]  # a pool call
            assert other.ask(p.Keys(0)).keys == []
            assert time.monotonic() - t0 < 3.0
        finally:
            for w in waiters:
                w.close()
            wait_until(lambda: svc.node_stats().connections == 1)
            other.close()


def test_idle_exit_after_the_last_client_left(sdir):
    svc = NodeService(service_config(sdir), idle_exit_s=1.0).run_in_thread()
    try:
        c = connect(svc)
        time.sleep(1.5)  # past idle_exit_s: the window in which the service must not exit
        assert not svc.wait_stopped(0)  # a client is attached: no idle exit
        c.close()
        t0 = time.monotonic()
        assert svc.wait_stopped(10), "the service did not exit after its last client left"
        assert 0.5 < time.monotonic() - t0 < 8 and svc.exit_status == 0
        assert not os.path.exists(svc.socket_path)
    finally:
        svc.stop(skip_waits=True, timeout_s=10)


_STATS_CLIENT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import msgspec
    from store_backend.node import protocol as p
    from tests.store_backend.node.server_harness import Raw
    a, b = Raw({path!r}), Raw({path!r})  # two connections of one process count together
    a.hello(name="engine")
    b.hello(name="engine")
    a.put("mine/1", b"m" * 5000)
    assert b.get("mine/1") == b"m" * 5000
    assert a.get("mine/1") == b"m" * 5000
    assert b.get("mine/absent") is None
    print(json.dumps(msgspec.to_builtins(b.ask(p.Stats(0, mine=True)).store)), flush=True)
    sys.stdin.read()
""")


def test_stats_mine_counts_what_one_client_process_did(svc):
    own = connect(svc)
    child = subprocess.Popen([sys.executable, "-c", _STATS_CLIENT.format(repo=str(REPO), path=svc.socket_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        theirs = json.loads(child.stdout.readline())
        assert theirs["store"]["puts"] == 1 and theirs["store"]["gets"] == 3
        assert theirs["dram"]["hits"] == 2 and theirs["dram"]["misses"] == 1
        assert theirs["dram"]["bytes_read"] == 10000 and theirs["dram"]["bytes_written"] == 5000
        mine = own.ask(p.Stats(0, mine=True)).store
        assert mine.store.puts == 0 and mine.dram.hits == 0  # this process did nothing yet
        whole = own.ask(p.Stats(0)).store
        assert whole.store.puts == 1 and whole.dram.hits == 2
    finally:
        child.stdin.close()
        child.wait(10)
        own.close()


def test_a_reservation_past_its_ttl_stays_held_as_zombie_and_a_lease_past_its_ttl_is_ended(svc):
    a, b = connect(svc), connect(svc)
    try:
        g = a.ask(p.Reserve(0, ["z/1"], [8192], ttl_s=0.3)).grants[0]
        b.put("z/2", b"2" * 4096)
        ls = b.ask(p.Lease(0, ["z/2"], ttl_s=0.3)).grants[0]
        # The expired reservation's key is free for another writer; its own bytes stay held (its
        # process may still write them). The lease is a read: the service ends it (TTL + 1 s).
        wait_until(lambda: b.ask(p.Exists(0, ["z/1"], count_reserved=True)).n == 0)
        wait_until(lambda: svc.node_stats().leases_expired == 1, what="the lease ended by the service")
        n = svc.node_stats()
        assert n.zombie_bytes == 8192 and n.held_bytes == 8192 and n.leases == 0
        assert a.ask(p.Commit(0, [g.token])).values == [Status.IO_ERROR]
        assert b.ask(p.Release(0, [ls.token])).values == [False]
        assert held(svc) == (0, 0, 0) and svc.node_stats().zombie_bytes == 0
    finally:
        a.close()
        b.close()


def test_a_slot_still_open_at_the_end_of_the_drain_is_reclaimed_and_never_stored(sdir, tmp_path):
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "io_engine": "posix"}
    svc = NodeService(service_config(sdir, drain_timeout_s=0.5, store={"ssd": ssd})).run_in_thread()
    a = connect(svc)
    try:
        a.put("e/kept", b"k" * 4096)
        g = a.ask(p.Reserve(0, ["e/open"], [4096])).grants[0]
        a.mapping[g.offset:g.offset + 4096] = b"o" * 4096  # written, never committed
        t0 = time.monotonic()
        assert svc.stop(timeout_s=30) == 0
        assert time.monotonic() - t0 >= 0.5  # it waited out the drain for the open slot
        assert a.closed_by_peer()
    finally:
        a.close()
        svc.stop(skip_waits=True, timeout_s=10)
    with TieredStore({"ssd": ssd}) as store:
        assert store.keys("e/") == ["e/kept"]


def test_keys_come_in_pages_from_one_snapshot(svc):
    c = connect(svc)
    try:
        want = sorted(f"pg/{i:03d}" for i in range(25))
        for k in want:
            c.put(k, b"k")
        c.put("other/1", b"o")
        got, cursor, pages = [], "", 0
        while True:
            page = c.ask(p.Keys(0, prefix="pg/", cursor=cursor, limit=10))
            assert isinstance(page, p.KeyPage) and len(page.keys) <= 10
            got += page.keys
            pages += 1
            if pages == 1:
                c.put("pg/999", b"late")  # stored after the first page: not in this listing
            if not page.cursor:
                break
            cursor = page.cursor
        assert got == want and pages == 3
        assert c.ask(p.Keys(0, prefix="pg/")).keys == [*want, "pg/999"]  # a new listing sees it
    finally:
        c.close()
