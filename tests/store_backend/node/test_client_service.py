"""NodeClient against the real NodeService (on a thread of the test process) where the client's own
behaviour is the subject: a connection the service closed for idling is replaced without the call
noticing; a stop (as SIGTERM) lets an open reservation commit within the drain while new saves are
refused and counted; the pool stays within its bound under many threads."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload, serve_node
from tests.store_backend.node.server_harness import wait_until

MiB = 1 << 20
DRAM = {"dram": {"capacity_bytes": 8 * MiB}}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_connection_closed_for_idling_is_replaced_without_the_call_noticing() -> None:
    c = serve_node(DRAM, idle_timeout_s=0.3)
    fds = _fds()  # the service's and the client's one connection
    try:
        assert c.put(["k"], [payload("k", 4096)]) == [Status.OK]
        connects = c.counters.connects
        # The service closes the idle connection (it holds no token): its end of it is gone.
        wait_until(lambda: c.service.idle_closed == 1 and _fds() == fds - 1, 10, "the idle connection closed")
        out = np.zeros(4096, np.uint8)
        assert c.get_into(["k"], [out]) == [ReadResult(Status.OK, 4096)] and np.array_equal(out, payload("k", 4096))
        assert c.counters.connects == connects + 1 and c.counters.failures == 0
        assert c.counters.loads_failed_disconnect == 0
        wait_until(lambda: c.service.idle_closed == 2 and _fds() == fds - 1, 10, "the new connection closed idle")
        assert c.exists(["k"]) == 1
        # the replaced connections' sockets are closed: one connection open, as before
        assert _fds() == fds
    finally:
        c.close(flush=False)


def test_a_stop_lets_an_open_reservation_commit_and_refuses_new_saves() -> None:
    c = serve_node(DRAM, drain_timeout_s=10.0)
    try:
        [r] = c.reserve(["open"], [4096])
        assert r.status is Status.OK
        stopped: list[int] = []
        t = threading.Thread(target=lambda: stopped.append(c.service.stop(timeout_s=30)))
        t.start()
        # draining: new saves are refused (and counted), the open reservation may still commit
        deadline = time.monotonic() + 10
        while c.put(["new"], [payload("new", 10)]) != [Status.IO_ERROR]:
            assert time.monotonic() < deadline, "the service never refused a new save"
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert c.counters.saves_dropped_disconnect >= 1
        np.frombuffer(r.view, np.uint8)[:] = payload("open", 4096)
        assert c.commit([r]) == [Status.OK]
        t.join(30)
        assert stopped == [0]
        # the service is gone now: misses, never an exception
        assert c.get_into(["open"], [bytearray(4096)]) == [ReadResult(Status.IO_ERROR)]
        assert c.exists(["open"]) == 0
    finally:
        c.close(flush=False)


def test_many_threads_share_a_bounded_pool() -> None:
    c = serve_node(DRAM)
    try:
        errors: list[str] = []

        def work(t: int) -> None:
            out = np.zeros(8192, np.uint8)
            for i in range(40):
                k = f"t{t}-{i % 5}"
                c.put([k], [payload(k, 8192)])
                r = c.get_into([k], [out])[0]
                if r.status is not Status.OK or not np.array_equal(out, payload(k, 8192)):
                    errors.append(f"{k}: {r}")
                if i % 7 == 0:
                    c.remove([k])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        stats = c.service_stats()
        assert stats is not None
        assert len(stats[1].clients) <= c.max_connections  # 12 threads, at most 4 connections
        assert c.counters.connects <= c.max_connections
    finally:
        c.close(flush=False)


def test_stats_mine_counts_this_process_only_and_stats_the_whole_store() -> None:
    c = serve_node(DRAM)
    try:
        keys = [f"k{i}" for i in range(3)]
        assert c.put(keys, [payload(k, 1024) for k in keys]) == [Status.OK] * 3
        c.service.store.put(["embedded"], [payload("embedded", 1024)])  # not through this client
        c.note_stuck_threads(1)
        mine, whole = c.stats(mine=True), c.stats()
        assert mine.store.puts == 3 and whole.store.puts == 4
        assert mine.store.thread_join_timeouts == 1 == whole.store.thread_join_timeouts
        assert c.metrics(mine=True)["store"]["puts"] == 3 and "client" in c.metrics()
        # The gauges are the one store's, in both: an engine's report of its own counters still
        # shows how full the store is.
        assert mine.dram.objects == whole.dram.objects == 4
        assert mine.dram.used_bytes == whole.dram.used_bytes > 0
        assert mine.dram.capacity_bytes == whole.dram.capacity_bytes > 0
    finally:
        c.close(flush=False)


def test_a_get_larger_than_this_process_share_is_read_in_rounds() -> None:
    """One client process may hold at most half the arena in leases: a get_into of more than that
    is leased, copied and released in rounds (as put stores in rounds), never answered IO_ERROR for
    the keys past the share."""
    c = serve_node({"dram": {"capacity_bytes": 1 * MiB}})
    try:
        keys = [f"r{i}" for i in range(12)]  # 12 x 64 KiB = 768 KiB, over the 512 KiB share
        assert c.put(keys, [payload(k, 64 * 1024) for k in keys]) == [Status.OK] * 12
        bufs = [bytearray(64 * 1024) for _ in keys]
        got = c.get_into(keys, bufs)
        assert got == [ReadResult(Status.OK, 64 * 1024)] * 12
        assert all(bytes(b) == payload(k, 64 * 1024).tobytes() for k, b in zip(keys, bufs))
        assert c.stats().slots.leases == 0
    finally:
        c.close(flush=False)


def test_a_batch_get_is_leased_in_groups_and_answers_as_one_call(monkeypatch) -> None:
    """get_into of several keys leases them a group at a time, the next group(s) in flight on the
    client's prefetch threads while this thread copies: over random batches (sizes across group
    bounds, absent keys, a buffer too small, a key twice) every answer and every byte is what one
    lease-copy-release of the whole batch gives, and no lease is left held."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from store_backend.node import client_slots

    monkeypatch.setattr(client_slots, "PIPELINE_GROUP_BYTES", 16 * 1024)
    c = serve_node({"dram": {"capacity_bytes": 8 * MiB}})
    try:
        sizes = {f"g{i}": 1 + (i * 7919) % (24 * 1024) for i in range(24)}
        keys = list(sizes)
        assert c.put(keys, [payload(k, n) for k, n in sizes.items()]) == [Status.OK] * len(keys)
        item = st.tuples(st.sampled_from([*keys, "absent-1", "absent-2"]), st.sampled_from([0, 0, 0, 5, -1]))

        @settings(max_examples=40, deadline=None)
        @given(st.lists(item, min_size=2, max_size=30))
        def check(batch: list[tuple[str, int]]) -> None:
            ks = [k for k, _ in batch]
            bufs = [bytearray(max(0, sizes.get(k, 64) + slack)) for k, slack in batch]
            got = c.get_into(ks, bufs)
            for (k, slack), buf, r in zip(batch, bufs, got):
                if k not in sizes:
                    assert r == ReadResult(Status.NOT_FOUND), (k, r)
                elif slack < 0:
                    assert r == ReadResult(Status.BUFFER_TOO_SMALL, sizes[k]), (k, r)
                else:
                    assert r == ReadResult(Status.OK, sizes[k]), (k, r)
                    assert bytes(buf[:sizes[k]]) == payload(k, sizes[k]).tobytes(), k
            assert c.stats().slots.leases == 0

        before = set(threading.enumerate())
        check()
        mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("node-prefetch-")]
        assert mine
    finally:
        c.close(flush=False)
    # The prefetch threads are the client's: closed with it.
    wait_until(lambda: not any(t.is_alive() for t in mine), 10, "the client's prefetch threads to end")
