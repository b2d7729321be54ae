"""A slot's memory is reused only when no process can still touch it (issue: "Safe to share").

Every test runs the real service in a process of its own and clients in processes of their own:
a writer whose connection is lost mid-copy (the service stopped past the client's op timeout, or a
frame left half sent) keeps its slot, so another process's object never lands in it; a malformed
call is refused before anything is sent, and a key the store rejects is answered INVALID_KEY by
the client without being sent; a commit the service does not answer is IO_ERROR and its slot's
abort is sent later, an abort or release that could not be sent is sent again; a lease held by a
stopped client ends at its TTL; a forked child cannot write through the views it inherited (nor,
forked from C code past Python's hook, reach the segment at all); a client whose pid the service
cannot see is refused at once."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import yaml

from store_backend.node.client import NodeAccessError, NodeClient
from store_backend.node.launch import spawn_service
from store_backend.node.server import NodeService  # noqa: F401  (the service under test)
from store_backend.types import MAX_KEY_BYTES, ReadResult, Status

from .server_harness import (
    REPO,
    ClientProcess,
    OtherProcess,
    ServiceProcess,
    service_config,
    unlink_free_segments,
    wait_until,
)

KiB = 1 << 10


@pytest.fixture
def service(sdir) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(service_config(sdir, frame_timeout_s=0.5), sdir)
    try:
        svc.wait_ready()
        yield svc
    finally:
        if svc.proc.poll() is None:
            svc.signal(signal.SIGCONT)
        svc.close()


def _held(c: NodeClient) -> tuple[int, int, int]:
    """(reservations, leases, held bytes) as the service's store counts them (asked again while
    the client backs off after a lost service)."""
    got = wait_until(c.service_stats, timeout_s=10, what="the service answering stats")
    return got[0].slots.reservations, got[0].slots.leases, got[0].slots.held_bytes


def _stalled(svc: ServiceProcess, call, seconds: float = 0.8):
    """``call()`` while the service is stopped (SIGSTOP) for at least ``seconds``."""
    svc.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = call()
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))  # the stall under test lasts this long
        return out
    finally:
        svc.signal(signal.SIGCONT)


def test_a_connection_lost_mid_write_keeps_the_slot_and_another_process_gets_other_memory(service) -> None:
    """The issue's case: writer A reserves 64 KiB and writes half; a call on the same connection
    times out while the service is stopped, so the connection is dropped; process B reserves,
    fills and commits key-B; A finishes and commits. Before: B got A's freed block and key-B read
    back with 32,768 of A's bytes."""
    a = NodeClient(service.socket_path, name="A", max_connections=1, op_timeout_s=0.5).start()
    b = ClientProcess(service.socket_path, name="B")
    try:
        [r] = a.reserve(["key-A"], [64 * KiB])
        assert r.status is Status.OK
        mine = np.frombuffer(r.view, np.uint8)
        mine[:32 * KiB] = 0xAA
        assert _stalled(service, lambda: a.exists(["anything"])) == 0  # the op timeout: a miss
        assert a.counters.disconnects >= 1
        got = b.run("""
            r = c.reserve(["key-B"], [65536])[0]
            np.frombuffer(r.view, np.uint8).fill(0xBB)
            v["out"] = [int(r.status), r.offset, int(c.commit([r])[0])]
        """)
        assert got[0] == 0 and got[2] == 0, got
        assert got[1] != r.offset  # A's slot is still A's
        mine[32 * KiB:] = 0xAA  # A's copy goes on after the lost call, as a real writer's would
        assert a.commit([r]) == [Status.OK]
        for key, byte in (("key-B", 0xBB), ("key-A", 0xAA)):
            out = bytearray(64 * KiB)
            assert a.get_into([key], [out]) == [ReadResult(Status.OK, 64 * KiB)]
            assert out == bytes([byte]) * (64 * KiB), key
        assert a.counters.forgets == 0  # the lost connection's only token was A's, kept
        assert _held(a) == (0, 0, 0)
    finally:
        b.kill()
        a.close(flush=False)


def test_a_malformed_key_is_refused_before_anything_is_sent_and_the_connection_stays(service) -> None:
    a = NodeClient(service.socket_path, name="A", max_connections=1).start()
    try:
        [r] = a.reserve(["ok/1"], [4 * KiB])
        sent = a.service_stats()[1].frames.get("exists", 0)
        connects = a.counters.connects
        for bad in ([b"oops"], [1], ["\ud800"], "one-str"):
            with pytest.raises((TypeError, ValueError)):
                a.exists(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            a.reserve(["x"], [4], parents=[b"p"])  # type: ignore[list-item]
        assert a.service_stats()[1].frames.get("exists", 0) == sent
        r.view[:] = b"k" * (4 * KiB)
        assert a.commit([r]) == [Status.OK]
        assert a.counters.connects == connects and a.counters.disconnects == 0
    finally:
        a.close(flush=False)


# Keys the store rejects (check_key): empty, with NUL, too long in UTF-8 bytes (ASCII and not).
INVALID = ["", "a\x00b", "k" * (MAX_KEY_BYTES + 1), "\u00e9" * (MAX_KEY_BYTES // 2 + 1)]


def test_keys_the_store_rejects_are_answered_by_the_client_and_never_sent(service) -> None:
    """Every call that takes keys answers an invalid key itself, as the service would (INVALID_KEY,
    absent, not pinned): a batch of only such keys sends no frame at all (the service's counters do
    not move), and a batch that mixes them with valid keys sends the valid ones and answers per
    key exactly as the service did when it was sent everything."""
    a = NodeClient(service.socket_path, name="A", max_connections=1).start()
    try:
        assert a.put(["ok/1"], [np.full(4096, 1, np.uint8)]) == [Status.OK]
        n = len(INVALID)
        before = a.service_stats()[1].frames
        assert a.put(INVALID, [b"x"] * n) == [Status.INVALID_KEY] * n
        assert a.get_into(INVALID, [bytearray(1) for _ in INVALID]) == [ReadResult(Status.INVALID_KEY)] * n
        assert [r.status for r in a.reserve(INVALID, [1] * n)] == [Status.INVALID_KEY] * n
        leases = a.lease(INVALID)
        assert [ls.status for ls in leases] == [Status.INVALID_KEY] * n and a.release(leases) == [False] * n
        assert a.remove(INVALID) == [Status.INVALID_KEY] * n
        assert a.contains(INVALID) == [False] * n
        assert a.size_of(INVALID) == [None] * n and a.tier_of(INVALID) == [None] * n
        assert a.exists(INVALID) == 0 and a.exists(INVALID, count_reserved=True, wait_s=5.0) == 0
        assert a.exists_all([["ok/1"], INVALID]) == 0
        assert a.pin(INVALID) == [False] * n
        a.unpin(INVALID)
        after = a.service_stats()[1].frames
        assert after == {**before, "stats": before.get("stats", 0) + 1}, (before, after)  # only the stats call
        assert a.counters.saves_dropped_disconnect == 0 and a.counters.loads_failed_disconnect == 0
        assert a.counters.failures == 0

        # A mixed batch: the valid keys go, each key answered as before.
        mixed = ["ok/1", "", "ok/2", "a\x00b"]
        assert a.put(mixed, [np.full(4096, i, np.uint8) for i in range(4)]) == [
            Status.EXISTS, Status.INVALID_KEY, Status.OK, Status.INVALID_KEY]
        outs = [bytearray(4096) for _ in mixed]
        assert a.get_into(mixed, outs) == [ReadResult(Status.OK, 4096), ReadResult(Status.INVALID_KEY),
                                           ReadResult(Status.OK, 4096), ReadResult(Status.INVALID_KEY)]
        assert outs[0] == b"\x01" * 4096 and outs[2] == b"\x02" * 4096
        assert a.contains(mixed) == [True, False, True, False]
        assert a.size_of(mixed) == [4096, None, 4096, None]
        assert a.tier_of(mixed) == ["dram", None, "dram", None]
        assert a.exists(mixed) == 1 and a.exists(["ok/1", "ok/2", ""]) == 2
        assert a.exists_all([["ok/1", "ok/2"], ["ok/2", "", "ok/1"]]) == 1
        assert a.pin(mixed, ttl_s=5.0) == [True, False, True, False]
        a.unpin(mixed)
        rs = a.reserve(["new/1", "", "new/2"], [16, 16, 16])
        assert [r.status for r in rs] == [Status.OK, Status.INVALID_KEY, Status.OK]
        assert rs[1].token == 0 and rs[1].view is None
        a.abort(rs)
        leases = a.lease(mixed)
        assert [ls.status for ls in leases] == [Status.OK, Status.INVALID_KEY, Status.OK, Status.INVALID_KEY]
        assert bytes(leases[2].view) == b"\x02" * 4096
        assert a.release(leases) == [True, False, True, False]
        assert a.remove(mixed) == [Status.OK, Status.INVALID_KEY, Status.OK, Status.INVALID_KEY]
        assert a.contains(["ok/1", "ok/2"]) == [False, False]
        assert _held(a) == (0, 0, 0)
    finally:
        a.close(flush=False)


def test_a_frame_left_half_sent_closes_the_connection_but_not_the_processs_slot(service) -> None:
    other = OtherProcess(service.socket_path)
    watcher = NodeClient(service.socket_path, name="watcher").start()
    try:
        assert other.run("""
            g = c.ask(p.Reserve(0, ["half/1"], [8192])).grants[0]
            c.mapping[g.offset:g.offset + 4096] = b"h" * 4096
            c.sock.sendall(p.encode(p.Exists(0, ["x"]))[:5])  # a thread stalls mid-frame
            v["g"] = g
            v["out"] = int(g.status)
        """) == 0
        assert other.run("c.closed_by_peer(5.0)") is True  # frame_timeout_s: 0.5
        assert _held(watcher)[0] == 1  # the process still holds its slot
        assert other.run("""
            g = v["g"]
            c.mapping[g.offset + 4096:g.offset + 8192] = b"h" * 4096
            c2 = Raw(c.sock.getpeername() if False else %r)
            c2.hello()
            v["out"] = [int(s) for s in c2.ask(p.Commit(0, [g.token])).values]
        """ % service.socket_path) == [0]
        out = bytearray(8192)
        assert watcher.get_into(["half/1"], [out]) == [ReadResult(Status.OK, 8192)]
        assert out == b"h" * 8192
    finally:
        other.kill()
        wait_until(lambda: _held(watcher) == (0, 0, 0), what="nothing held once the process exited")
        watcher.close(flush=False)


def test_a_release_the_service_did_not_answer_is_owed_and_sent_again(service) -> None:
    a = NodeClient(service.socket_path, name="A", max_connections=1, op_timeout_s=0.5,
                   connect_timeout_s=0.5).start()
    try:
        assert a.put(["rel/1"], [np.full(8192, 7, np.uint8)]) == [Status.OK]
        [ls] = a.lease(["rel/1"])
        assert ls.status is Status.OK and bytes(ls.view) == bytes([7]) * 8192
        assert _stalled(service, lambda: a.release([ls])) == [False]  # not answered: the read is dropped
        assert a.counters.owed_retries == 0
        assert _held(a)[1] == 0  # the next call sends the owed release first
        assert a.counters.owed_retries == 1
        [r] = a.reserve(["rel/2"], [4096])
        assert _stalled(service, lambda: a.abort([r])) is None
        assert _held(a) == (0, 0, 0)
        assert a.counters.owed_retries == 2
    finally:
        a.close(flush=False)


def test_a_commit_the_service_does_not_answer_is_io_error_and_its_abort_reaches_the_service(service) -> None:
    """The service is stopped (SIGSTOP) past the client's op timeout while it commits: the commit
    is tried again once on another connection, then answered IO_ERROR and counted in
    ``saves_dropped_disconnect``; the slot's abort is owed. After SIGCONT the next call sends it
    first, and the service took it: no reservation is left, and nothing was committed (the key
    is not readable). The reservation's TTL (1 s) passes during the 2 s stall, so the commit frame
    that was already on its way, which the service reads once it runs again, is refused there too
    (without the TTL lapse it would land: the writer had finished its copy, so the key would hold
    exactly its bytes although the client said IO_ERROR; either way no other key's bytes)."""
    a = NodeClient(service.socket_path, name="A", max_connections=1, op_timeout_s=0.5,
                   connect_timeout_s=0.5).start()
    try:
        [r] = a.reserve(["unanswered/1"], [8 * KiB], ttl_s=1.0)
        assert r.status is Status.OK
        r.view[:] = b"u" * (8 * KiB)
        stats, node = a.service_stats()
        commits, aborts = stats.store.slot_commits, node.frames.get("abort", 0)
        assert _stalled(service, lambda: a.commit([r]), seconds=2.0) == [Status.IO_ERROR]
        assert a.counters.saves_dropped_disconnect == 1 and a.counters.disconnects >= 1
        assert a.counters.owed_retries == 0  # owed, not sent yet
        assert _held(a) == (0, 0, 0)  # the next call (stats) sent the owed abort first
        assert a.counters.owed_retries == 1
        stats, node = a.service_stats()
        assert node.frames.get("abort", 0) == aborts + 1  # the abort reached the service
        assert node.reservations == 0 and stats.slots.reservations == 0
        assert stats.store.slot_commits == commits  # nothing was committed
        assert a.contains(["unanswered/1"]) == [False]
        assert a.get_into(["unanswered/1"], [bytearray(8 * KiB)]) == [ReadResult(Status.NOT_FOUND)]
        # The key is free again for a writer.
        assert a.put(["unanswered/1"], [np.full(8 * KiB, 9, np.uint8)]) == [Status.OK]
    finally:
        a.close(flush=False)


def test_a_stopped_client_cannot_hold_its_share_past_its_leases_ttl(service) -> None:
    a = NodeClient(service.socket_path, name="A").start()
    stuck = ClientProcess(service.socket_path, name="stuck")
    try:
        assert a.put(["ttl/1"], [np.full(4 * KiB << 8, 3, np.uint8)]) == [Status.OK]  # 1 MiB
        assert stuck.run('v.update(l=c.lease(["ttl/1"], ttl_s=1.0)) or int(v["l"][0].status)') == 0
        os.kill(stuck.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _held(a)[1] == 0, timeout_s=10, what="the stopped client's lease ended at its TTL")
            assert a.service_stats()[1].leases_expired == 1
        finally:
            os.kill(stuck.pid, signal.SIGCONT)
        assert stuck.run('c.release(v["l"])') == [False]  # what it read is not to be trusted
    finally:
        stuck.kill()
        a.close(flush=False)


def test_a_forked_child_cannot_write_through_the_views_it_inherited(service) -> None:
    """A client process reserves a slot and forks; the child keeps writing through the inherited
    view. The parent is killed, so the service reclaims the slot and hands the same block to the
    next writer: the child's writes must not reach it."""
    parent = ClientProcess(service.socket_path, name="parent")
    b = NodeClient(service.socket_path, name="B").start()
    child = 0
    try:
        got = parent.run("""
            r = c.reserve(["fork/1"], [65536])[0]
            view = np.frombuffer(r.view, np.uint8)
            child = os.fork()
            if child == 0:
                while True:  # the child writes through what it inherited, for good
                    view.fill(0xCC)
                    time.sleep(0.001)  # the child's write pace
            v["out"] = [int(r.status), r.offset, child]
        """)
        assert got[0] == 0, got
        offset, child = got[1], got[2]
        parent.kill()
        wait_until(lambda: _held(b) == (0, 0, 0), what="the parent's slot reclaimed at its exit")
        [r] = b.reserve(["fork/2"], [65536])
        assert r.status is Status.OK and r.offset == offset  # the very block the child still "writes"
        np.frombuffer(r.view, np.uint8).fill(0x11)
        assert b.commit([r]) == [Status.OK]
        time.sleep(0.2)  # the window the child's writes must not land in (its loop runs a few hundred times)
        out = bytearray(65536)
        assert b.get_into(["fork/2"], [out]) == [ReadResult(Status.OK, 65536)]
        assert out == b"\x11" * 65536
    finally:
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        b.close(flush=False)


def test_a_child_forked_from_c_gets_no_mapping_of_the_segment(service) -> None:
    """A fork from C code (here libc's fork() through ctypes) skips Python's at-fork hook, so only
    the kernel keeps the child off the shared segment (MADV_DONTFORK on the client's mapping): the
    child finds the slot's address unmapped in /proc/self/maps and dies of SIGSEGV when it writes
    there, and the parent's slot keeps the parent's bytes. A child of multiprocessing's fork start
    and a subprocess still work with the client open (the hook gives a Python child private memory
    at those addresses, and its client attaches anew)."""
    parent = ClientProcess(service.socket_path, name="parent")
    b = NodeClient(service.socket_path, name="B").start()
    try:
        got = parent.run("""
            import ctypes
            r = c.reserve(["cfork/1"], [65536])[0]
            view = np.frombuffer(r.view, np.uint8)
            view.fill(0xAA)
            addr = view.ctypes.data
            rd, wr = os.pipe()
            pid = ctypes.PyDLL(None).fork()  # libc's fork(): Python's at-fork hooks do not run
            if pid == 0:  # the child: raw os calls only, then _exit
                os.close(rd)
                fd = os.open("/proc/self/maps", os.O_RDONLY)
                while True:
                    piece = os.read(fd, 65536)
                    if not piece:
                        break
                    os.write(wr, piece)
                os.close(fd)
                ctypes.memset(addr, 0xCC, 65536)  # through the inherited address: SIGSEGV when unmapped
                os.write(wr, b"WROTE")
                os._exit(0)
            os.close(wr)
            maps = b""
            while True:
                piece = os.read(rd, 65536)
                if not piece:
                    break
                maps += piece
            os.close(rd)
            _, status = os.waitpid(pid, 0)
            v["r"] = r
            v["out"] = [addr, maps.decode(), os.WIFSIGNALED(status) and os.WTERMSIG(status), int(r.status)]
        """)
        addr, maps, signalled, status = got
        assert status == 0, got
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps.splitlines()
                 if not line.startswith("WROTE")]
        assert spans and not any(lo <= addr < hi for lo, hi in spans), "the C-forked child has the segment mapped"
        assert "WROTE" not in maps and signalled == signal.SIGSEGV, (signalled, maps[-200:])
        assert parent.run('[int(s) for s in c.commit([v["r"]])]') == [0]
        out = bytearray(65536)
        assert b.get_into(["cfork/1"], [out]) == [ReadResult(Status.OK, 65536)]
        assert out == b"\xaa" * 65536
        # Forking with the client open, the ordinary ways, still works.
        assert parent.run("""
            import multiprocessing, subprocess, sys
            def child_put():
                ok = c.put(["mp/1"], [np.full(4096, 7, np.uint8)]) == [Status.OK]
                os._exit(0 if ok else 3)
            pr = multiprocessing.get_context("fork").Process(target=child_put)
            pr.start()
            pr.join(30)
            ran = subprocess.run([sys.executable, "-c", "print('spawned')"], capture_output=True, text=True, timeout=30)
            v["out"] = [pr.exitcode, ran.stdout.strip(), c.exists(["cfork/1", "mp/1"])]
        """) == [0, "spawned", 2]
        assert b.get_into(["mp/1"], [out]) == [ReadResult(Status.OK, 4096)] and out[:4096] == b"\x07" * 4096
    finally:
        parent.kill()
        b.close(flush=False)


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"), reason="needs root for a pid namespace")
def test_a_client_whose_pid_the_service_cannot_see_is_refused(sdir) -> None:
    """The service in a pid namespace of its own sees a client of the host as pid 0: it could never
    tell when that process stops touching a slot, so it refuses it at once, naming why."""
    assert shutil.which("unshare"), "unshare (util-linux) is needed"
    cfg = service_config(sdir)
    path = os.path.join(sdir, "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = open(os.path.join(sdir, "node.log"), "wb")
    proc = spawn_service(path, log, prefix=["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, new_session=False)
    try:
        def refused() -> str | None:
            try:
                NodeClient(cfg["socket"], connect_timeout_s=2).start().close(flush=False)
            except NodeAccessError as e:
                return str(e)
            except ConnectionError:
                return None
            raise AssertionError("the service attached a client whose pid it cannot see")

        msg = wait_until(refused, timeout_s=60, what="the service refusing the unseen client")
        assert "pid namespace" in msg and cfg["socket"] in msg
    finally:
        proc.kill()  # unshare passes SIGTERM on to the service (--kill-child) as it dies
        proc.wait(10)
        wait_until(lambda: not os.path.exists(cfg["socket"]), timeout_s=30, what="the service stopped")
        log.close()
        unlink_free_segments(cfg["store"]["dram"]["shm_name"])
