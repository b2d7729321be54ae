"""Per-client limits of the node service, held by real client processes: the arena share of one
process covers its reservations, leases and pins (a process over it is refused, the others are
not), pins end with the process that took them, connections per process and the memory the
service holds for clients' frames (incomplete, queued, being answered, and the replies) are
bounded."""

from __future__ import annotations

import signal

import numpy as np

from store_backend.node import protocol as p
from store_backend.node.client import NodeClient
from store_backend.types import Status

from .server_harness import ClientProcess, Raw, ServiceProcess, service_config, wait_until

MiB = 1 << 20


def _service(sdir: str, **over) -> ServiceProcess:
    svc = ServiceProcess(service_config(sdir, **over), sdir)
    svc.wait_ready()
    return svc


def _slots(c: NodeClient):
    got = wait_until(c.service_stats, what="the service answering stats")
    return got[0].slots


def test_a_process_that_pins_everything_and_exits_does_not_lock_the_arena(sdir) -> None:
    """The issue's case: one client pins every resident object (an hour's TTL) and exits; before,
    every other client's save answered NO_SPACE (0 of 4 stored)."""
    svc = _service(sdir)
    b = NodeClient(svc.socket_path, name="B").start()
    pinner = ClientProcess(svc.socket_path, name="pinner")
    try:
        keys = [f"res/{i}" for i in range(15)]  # 15 MiB of the 16 MiB arena
        assert b.put(keys, [np.full(MiB, i, np.uint8) for i in range(15)]) == [Status.OK] * 15
        pinned = pinner.run(f"c.pin({keys!r}, ttl_s=3600.0)")
        # Pins count against the pinner's share (half the arena, whole blocks): not all of them.
        assert 0 < sum(pinned) <= 8 and pinned[:sum(pinned)] == [True] * sum(pinned), pinned
        assert _slots(b).pins == sum(pinned) and _slots(b).pinned_bytes == sum(pinned) * MiB
        new = [f"new/{i}" for i in range(4)]
        assert b.put(new, [np.full(MiB, 0x40 + i, np.uint8) for i in range(4)]) == [Status.OK] * 4
        pinner.kill()  # its pins end with it
        wait_until(lambda: _slots(b).pins == 0, what="the exited pinner's pins ended")
        more = [f"more/{i}" for i in range(12)]
        assert b.put(more, [np.full(MiB, 0x80 + i, np.uint8) for i in range(12)]) == [Status.OK] * 12
        out = bytearray(MiB)
        for i, k in enumerate(more):
            assert b.get_into([k], [out])[0].status is Status.OK and out == bytes([0x80 + i]) * MiB
    finally:
        pinner.kill()
        b.close(flush=False)
        svc.close()


def test_a_process_over_its_share_is_refused_and_another_process_is_not(sdir) -> None:
    svc = _service(sdir)
    b = NodeClient(svc.socket_path, name="B").start()
    greedy = ClientProcess(svc.socket_path, name="greedy")
    try:
        assert b.put(["p/1"], [np.full(MiB, 1, np.uint8)]) == [Status.OK]
        got = greedy.run("""
            rs = c.reserve([f"g/{i}" for i in range(6)], [MiB] * 6)
            ls = c.lease(["p/1", "p/1", "p/1"])
            v["rs"], v["ls"] = rs, ls
            v["out"] = [int(r.status) for r in rs] + [int(x.status) for x in ls]
        """.replace("MiB", str(MiB)))
        # 8 MiB share: six reservations and two leases fit, the ninth slot does not.
        assert got == [0] * 6 + [0, 0, int(Status.NO_SPACE)], got
        assert greedy.run('[int(s) for s in c.put(["g/x"], [np.zeros(4096, np.uint8)])]') == [int(Status.NO_SPACE)]
        assert greedy.run('c.pin(["p/1"])') == [False]  # a pin counts too
        # Another process is not held up by it.
        rs = b.reserve([f"b/{i}" for i in range(4)], [MiB] * 4)
        assert [r.status for r in rs] == [Status.OK] * 4
        b.abort(rs)
        assert b.pin(["p/1"]) == [True]
        b.unpin(["p/1"])
    finally:
        greedy.kill()
        wait_until(lambda: _slots(b).held_bytes == 0, what="the greedy process's slots reclaimed at its exit")
        b.close(flush=False)
        svc.close()


def test_an_unpin_from_another_process_ends_the_pinners_pin(sdir) -> None:
    """vLLM's scheduler pins in one process, its worker loads and unpins in another."""
    svc = _service(sdir)
    worker = NodeClient(svc.socket_path, name="worker").start()
    scheduler = ClientProcess(svc.socket_path, name="scheduler")
    try:
        assert worker.put(["u/1"], [np.zeros(MiB, np.uint8)]) == [Status.OK]
        assert scheduler.run('c.pin(["u/1"], ttl_s=600.0)') == [True]
        assert _slots(worker).pins == 1
        worker.unpin(["u/1"])
        assert _slots(worker).pins == 0 and _slots(worker).pinned_bytes == 0
        worker.unpin(["u/1"])  # nothing more to end: nothing happens
    finally:
        scheduler.kill()
        worker.close(flush=False)
        svc.close()


def test_connections_per_process_are_bounded(sdir) -> None:
    svc = _service(sdir, max_connections_per_client=3)
    conns: list[Raw] = []
    other = None
    try:
        for _ in range(3):
            c = Raw(svc.socket_path)
            assert isinstance(c.hello(want_segment=False), p.Welcome)
            conns.append(c)
        extra = Raw(svc.socket_path)
        conns.append(extra)
        refused = extra.read(5.0)
        assert isinstance(refused, p.Error) and refused.code == "busy" and "max_connections_per_client" in \
            refused.message
        other = ClientProcess(svc.socket_path, name="other")  # another process still attaches
        assert other.run('c.exists(["x"])') == 0
    finally:
        if other is not None:
            other.kill()
        for c in conns:
            c.close()
        svc.close()


def test_incomplete_frames_of_all_connections_hold_at_most_max_buffered_bytes(sdir) -> None:
    svc = _service(sdir, max_buffered_bytes=MiB, frame_timeout_s=10.0)
    a, b, stats = Raw(svc.socket_path), Raw(svc.socket_path), Raw(svc.socket_path)
    try:
        for c in (a, b, stats):
            assert isinstance(c.hello(want_segment=False), p.Welcome)
        big = p.encode(p.Exists(7, [f"k{i:07d}" + "x" * 100 for i in range(8000)]))  # ~0.9 MiB
        assert len(big) > 700_000
        a.sock.sendall(big[:700_000])
        wait_until(lambda: stats.ask(p.Stats(0)).node.buffered_bytes >= 600_000, what="a's part read")
        b.sock.sendall(big[:400_000])  # together past 1 MiB: b is closed, busy
        reply = b.read(5.0)
        assert isinstance(reply, p.Error) and reply.code == "busy" and "max_buffered_bytes" in reply.message
        assert b.closed_by_peer()
        a.sock.sendall(big[700_000:])  # a's frame completes and is answered
        got = a.read(5.0)
        assert isinstance(got, p.Count) and got.id == 7
        assert stats.ask(p.Stats(0)).node.buffered_bytes == 0
    finally:
        for c in (a, b, stats):
            c.close()
        svc.close()


def test_frames_queued_or_being_answered_and_replies_count_against_max_buffered_bytes(sdir) -> None:
    """Complete frames a connection sent behind a request that waits, and that request itself, are
    held by the service as much as an incomplete frame is: they count in ``buffered_bytes``, so
    another connection's frame that would take the total past ``max_buffered_bytes`` is refused
    (busy) while the first connection's frames are all answered in order. A reply its peer does
    not read is held, and counted, until it is sent or the connection ends. (Before, only
    incomplete frames counted.)"""
    svc = _service(sdir, max_buffered_bytes=MiB, frame_timeout_s=10.0)
    w, a, b, stats = (Raw(svc.socket_path) for _ in range(4))
    r = None
    try:
        for c in (w, a, b, stats):
            assert isinstance(c.hello(want_segment=False), p.Welcome)
        grant = w.ask(p.Reserve(0, ["pending/1"], [4096])).grants[0]
        assert grant.status == 0
        waiting = p.encode(p.Exists(1, ["pending/1"], False, 20.0))  # waits for the commit
        queued = [p.Contains(2 + i, [f"q{i}/{j:05d}" + "x" * 40 for j in range(600)]) for i in range(4)]
        queued_bytes = b"".join(p.encode(m) for m in queued)
        assert 100_000 < len(queued_bytes) < 200_000
        # Stopped, so that every byte is in the socket when the service reads: one read takes the
        # waiting request and the frames behind it.
        svc.signal(signal.SIGSTOP)
        try:
            a.sock.sendall(waiting + queued_bytes)
        finally:
            svc.signal(signal.SIGCONT)
        held = wait_until(lambda: (n := stats.ask(p.Stats(0)).node.buffered_bytes) >= len(queued_bytes) and n,
                          timeout_s=5, what="the frames queued behind a waiting request counted")
        assert held < len(queued_bytes) + len(waiting) + 1024, held
        big = p.encode(p.Exists(7, [f"k{i:07d}" + "x" * 100 for i in range(9000)]))  # ~0.95 MiB, complete
        assert MiB - len(queued_bytes) < len(big) < MiB
        b.sock.sendall(big)
        reply = b.read(5.0)
        assert isinstance(reply, p.Error) and reply.code == "busy" and "max_buffered_bytes" in reply.message, reply
        assert b.closed_by_peer()
        assert isinstance(w.ask(p.Commit(0, [grant.token])), p.Statuses)
        got = a.read(10.0)
        assert isinstance(got, p.Count) and got.id == 1 and got.n == 1, got
        for m in queued:
            got = a.read(10.0)
            assert isinstance(got, p.Bools) and got.id == m.id and got.values == [False] * 600, got
        wait_until(lambda: stats.ask(p.Stats(0)).node.buffered_bytes == 0, timeout_s=5, what="nothing held")
        # A reply the peer does not read: ~480 KB (a grant per key) for a ~160 KB request, more
        # than the socket takes; held, and counted, while the service tries to send it.
        r = Raw(svc.socket_path)
        assert isinstance(r.hello(want_segment=False), p.Welcome)
        request = p.encode(p.Lease(9, ["a"] * 80_000))
        assert len(request) < 200_000
        r.sock.sendall(request)
        wait_until(lambda: stats.ask(p.Stats(0)).node.buffered_bytes >= len(request) + 300_000, timeout_s=10,
                   what="the unread reply counted")
        r.close()
        wait_until(lambda: stats.ask(p.Stats(0)).node.buffered_bytes == 0, timeout_s=15,
                   what="the reply dropped with its connection")
    finally:
        for c in (w, a, b, stats, *([r] if r is not None else [])):
            c.close()
        svc.close()
