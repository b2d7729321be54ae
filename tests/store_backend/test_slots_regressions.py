"""Regressions of the slot API (reserve/lease/reclaim), each found by a review with a reproducer.

These need the embedded store's internals (a hook between two steps of a stage-in, the allocator's
books), so they run against :class:`~store_backend.store.TieredStore` only.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from store_backend.store import TieredStore
from store_backend.types import Status

KiB = 1 << 10
MiB = 1 << 20
SIZE = 64 * KiB


def tagged(tag: int, size: int = SIZE) -> np.ndarray:
    """Self-describing bytes: every 8-byte word is tag * 2**32 + its index."""
    return (np.arange(size // 8, dtype=np.uint64) + np.uint64(tag << 32)).view(np.uint8)


def tags(buf: object) -> set[int]:
    return set((np.frombuffer(bytes(buf), np.uint64) >> np.uint64(32)).tolist())


def ssd_store(tmp: str, *, promote: bool = False, dram_bytes: int = 1 * MiB) -> TieredStore:
    return TieredStore({"dram": {"capacity_bytes": dram_bytes, "eviction_policy": "lru"},
                        "ssd": {"path": f"{tmp}/ssd", "capacity_bytes": 64 * MiB, "admission_policy": "all"},
                        "promotion": {"enabled": promote, "admission_hits": 1}}).start()


def push_to_ssd(s: TieredStore, key: str, tag: int, n_fill: int = 24) -> None:
    """Store ``key`` and push it out of DRAM (it stays on SSD only)."""
    assert s.put([key], [tagged(tag)]) == [Status.OK]
    assert s.flush(timeout_s=30)
    for i in range(n_fill):
        s.put([f"fill{i}"], [tagged(10_000 + i)])
        assert s.flush(timeout_s=30)
    assert s.tier_of([key]) == ["ssd"]


def allocator_matches_index(s: TieredStore) -> bool:
    """With no token held, the allocator's used bytes are exactly the index's entries' blocks."""
    snap = s.dram_snapshot()
    return snap.used_bytes == sum(e.block_bytes for e in snap.entries.values())


@pytest.fixture
def tmp() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        yield d


def reclaim_after_stage_in(s: TieredStore, owner: int, then: object = None) -> None:
    """Run ``reclaim(owner)`` (from another thread, as the node service does when the owner's
    connection ends during the call) right after the stage-in step of a lease."""
    orig = s._stage_in_once

    def gap(*a: object, **kw: object) -> None:
        orig(*a, **kw)
        t = threading.Thread(target=s.reclaim, args=(owner,))
        t.start()
        t.join()
        if callable(then):
            then()

    s._stage_in_once = gap  # type: ignore[method-assign]


# -- F1: a repeated key of a stage-in lease was leased after the lock was dropped --------------------
@pytest.mark.parametrize("promote", [False, True])
def test_a_repeated_stage_in_key_is_leased_with_its_first_mention(tmp: str, promote: bool) -> None:
    """lease([k, k]) of an SSD-only key, and a reclaim of the owner right after the stage-in: the
    repeat used to be leased after that, on the freed (or, promoted, evicted) entry: an OK lease of
    another object's bytes, whose release freed that object's block (double free, wrong bytes)."""
    s = ssd_store(tmp, promote=promote)
    try:
        push_to_ssd(s, "k", tag=1)
        churn = (lambda: [s.put([f"other{i}"], [tagged(500 + i)]) for i in range(16)]) if promote else None
        reclaim_after_stage_in(s, 5, churn)
        leases = s.lease(["k", "k"], owner=5)
        del s._stage_in_once
        assert [ls.status for ls in leases] == [Status.OK, Status.OK]
        g = s.stats().slots
        assert (g.leases, g.held_bytes) == (0, 0), "a lease was granted after its owner was reclaimed"
        assert s.release(leases, owner=5) == [False, False]
        assert allocator_matches_index(s)
        # Nothing was freed twice: a new object's block is its own.
        assert s.put(["victim"], [tagged(77)]) == [Status.OK]
        assert s.put(["intruder"], [tagged(99)]) == [Status.OK]
        out = np.zeros(SIZE, np.uint8)
        assert s.get_into(["victim"], [out])[0].status is Status.OK and tags(out) == {77}
        assert s.stats().store.arena_double_frees == 0
    finally:
        s.close(flush=False)


def test_repeats_racing_reclaim_leave_the_allocator_consistent(tmp: str) -> None:
    """No hook: a thread leases [k, k, k] (SSD-only, transient slots) while the owner is reclaimed
    again and again, and once more after the call (the service's disconnect and reclaim_later).
    Reclaim never raises and afterwards the allocator holds only the index's blocks."""
    s = ssd_store(tmp)
    switch = sys.getswitchinterval()
    try:
        push_to_ssd(s, "k", tag=1)
        sys.setswitchinterval(1e-6)  # threads switch often: the reclaim lands inside the call
        end = time.monotonic() + 4.0
        n = 0
        while time.monotonic() < end:
            n += 1
            errs: list[BaseException] = []

            def call(owner: int = n) -> None:
                try:
                    for ls in s.lease(["k", "k", "k"], owner=owner):
                        assert ls.status is not Status.OK or tags(ls.view) <= {1}
                except BaseException as e:  # noqa: BLE001 - reported below
                    errs.append(e)

            t = threading.Thread(target=call)
            t.start()
            time.sleep(random.random() * 0.002)  # a random head start: where the reclaims meet the lease varies
            while t.is_alive():
                s.reclaim(n)
            t.join()
            s.reclaim(n)
            assert not errs, errs
            assert allocator_matches_index(s), f"iteration {n}"
        assert s.stats().store.arena_double_frees == 0
    finally:
        sys.setswitchinterval(switch)
        s.close(flush=False)


def test_an_entry_freed_twice_is_left_alone_and_counted() -> None:
    """The guard behind F1: giving a block back twice never frees a block that another object
    owns by now (it is counted and logged instead), and a reclaim with such a token still ends
    every other token of the owner."""
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}).start()
    try:
        assert s.put(["a"], [tagged(1)]) == [Status.OK]
        e = s._dram.entries["a"]
        [r] = s.reserve(["b"], [SIZE], owner=3)
        [ls] = s.lease(["a"], owner=3)
        with s._lock:  # make "a" a freed block still named by a lease (what F1 produced)
            del s._dram.entries["a"]
            assert s._dram.free(e)
        assert s.put(["c"], [tagged(3)]) == [Status.OK]  # may take a's block
        assert s.reclaim(3) == (1, 1)  # ends both tokens; frees nothing twice
        assert s.stats().store.arena_double_frees == 1
        assert s.stats().slots.held_bytes == 0 and allocator_matches_index(s)
        out = np.zeros(SIZE, np.uint8)
        assert s.get_into(["c"], [out])[0].status is Status.OK and tags(out) == {3}
        assert ls.status is Status.OK and r.status is Status.OK
    finally:
        s.close(flush=False)


# -- F4: reclaim(owner) and the slot gauges scanned every token of every owner, under the store lock --
class _NoScan(dict):
    """A row table that may be looked up but never walked (a walk is O(all tokens))."""

    def _walk(self, *_a: object) -> None:
        raise AssertionError("walked every token of every owner")

    items = values = keys = __iter__ = _walk  # type: ignore[assignment]


def test_reclaim_and_stats_do_not_walk_every_owners_tokens() -> None:
    s = TieredStore({"dram": {"capacity_bytes": 4 * MiB, "eviction_policy": "lru"}}).start()
    try:
        assert s.put(["o"], [tagged(1, 8)]) == [Status.OK]
        for owner in (1, 2, 3):
            assert all(ls.status is Status.OK for ls in s.lease(["o"] * 100, owner=owner))
        [mine] = s.lease(["o"], owner=4)
        s._slots._rows = _NoScan(s._slots._rows)
        g = s.stats().slots
        assert (g.leases, g.owners) == (301, 4)
        assert s.reclaim(4) == (0, 1)
        assert s.release([mine], owner=4) == [False]
        assert s.stats().slots.leases == 300
        assert s.reclaim(2) == (0, 100)
        assert s.stats().slots.owners == 2
    finally:
        s.close(flush=False)


# -- F2: the share counted requested bytes, the arena hands out whole alignment units --------------
@pytest.mark.parametrize("size", [0, 1])
def test_tiny_slots_count_their_whole_block_against_the_share(size: int) -> None:
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}).start()
    try:
        n = MiB // 4096
        got = s.reserve([f"g{i}" for i in range(n)], [size] * n, owner=1)
        ok = sum(r.status is Status.OK for r in got)
        assert ok == n // 2 and s.stats().slots.held_bytes == ok * 4096
        assert s.stats().dram.used_bytes <= MiB // 2
        assert s.reserve(["o"], [4096], owner=2)[0].status is Status.OK
        assert s.put(["p"], [tagged(1, 4096)]) == [Status.OK]
        assert s.put(["q"], [tagged(1, 8)]) == [Status.OK]
        assert [ls.status for ls in s.lease(["q"] * 3, owner=1)] == [Status.NO_SPACE] * 3  # a lease too
    finally:
        s.close(flush=False)


# -- F3: a stage-in lease checked each key against what the owner held before the batch ------------
def test_a_stage_in_past_the_share_is_refused_before_it_evicts(tmp: str) -> None:
    s = ssd_store(tmp)  # 1 MiB arena = 16 objects; a share: 8
    try:
        cold = [f"cold{i}" for i in range(16)]
        for i, k in enumerate(cold):
            assert s.put([k], [tagged(i)]) == [Status.OK]
        assert s.flush(timeout_s=30)
        hot = [f"hot{i}" for i in range(16)]
        for i, k in enumerate(hot):
            assert s.put([k], [tagged(100 + i)]) == [Status.OK]
        assert s.flush(timeout_s=30)
        assert set(s.tier_of(cold)) == {"ssd"} and set(s.tier_of(hot)) == {"dram"}
        leases = s.lease(cold, owner=1)
        assert [ls.status for ls in leases] == [Status.OK] * 8 + [Status.NO_SPACE] * 8
        assert all(tags(ls.view) == {i} for i, ls in enumerate(leases[:8]))
        assert s.stats().store.slot_stage_ins == 8  # no read for a key refused
        assert sum(t == "dram" for t in s.tier_of(hot)) == 8  # evicted only what the 8 leases needed
        assert s.release(leases, owner=1) == [True] * 8 + [False] * 8
        # Repeats count too: [c, c, c, ...] of one key is one read, as many tokens.
        leases = s.lease([cold[9]] * 3 + cold[10:16], owner=2)
        assert [ls.status for ls in leases] == [Status.OK] * 8 + [Status.NO_SPACE]
        s.release(leases, owner=2)
    finally:
        s.close(flush=False)


# -- F5: an object larger than one share answered NO_SPACE (retry) for ever ------------------------
def test_an_object_larger_than_a_share_is_too_large(tmp: str) -> None:
    s = ssd_store(tmp)
    try:
        big = 600 * KiB  # fits the 1 MiB arena, never a share (512 KiB)
        assert s.put(["big"], [tagged(5, big)]) == [Status.OK]  # a put holds no share
        assert s.reserve(["big2"], [big])[0].status is Status.TOO_LARGE
        assert s.lease(["big"])[0].status is Status.TOO_LARGE
        assert s.flush(timeout_s=30)
        for i in range(24):  # push big out of DRAM: a stage-in answers the same
            s.put([f"fill{i}"], [tagged(1000 + i)])
            assert s.flush(timeout_s=30)
        assert s.tier_of(["big"]) == ["ssd"]
        assert [ls.status for ls in s.lease(["big", "big"])] == [Status.TOO_LARGE] * 2
        assert s.stats().store.slot_stage_ins == 0 and s.stats().slots.held_bytes == 0
    finally:
        s.close(flush=False)
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}).start()
    try:
        [half] = s.reserve(["half"], [512 * KiB])
        assert half.status is Status.OK  # a whole share is not too large
    finally:
        s.close(flush=False)


# -- F12 (node review): a share per process, tokens per connection ---------------------------------
def test_owners_of_one_group_share_one_share_and_are_reclaimed_apart() -> None:
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}).start()
    try:
        a = s.reserve([f"a{i}" for i in range(5)], [SIZE] * 5, owner=1, group=42)
        b = s.reserve([f"b{i}" for i in range(5)], [SIZE] * 5, owner=2, group=42)
        assert [r.status for r in a] == [Status.OK] * 5
        assert [r.status for r in b] == [Status.OK] * 3 + [Status.NO_SPACE] * 2  # 8 per share
        assert s.put(["p"], [tagged(1)]) == [Status.OK]
        assert s.lease(["p"], owner=2, group=42)[0].status is Status.NO_SPACE
        assert s.reserve(["c"], [SIZE], owner=3)[0].status is Status.OK  # another share is not held up
        assert s.reserve(["d"], [SIZE], owner=42)[0].status is Status.OK  # owner 42 is not group 42
        assert s.commit(b[:1], owner=1) == [Status.IO_ERROR]  # tokens stay the owner's own
        assert s.reclaim(1) == (5, 0)  # ends owner 1's tokens only
        assert s.stats().slots.reservations == 5
        [ls] = s.lease(["p"], owner=2, group=42)
        assert ls.status is Status.OK
        with pytest.raises(TypeError, match="group"):
            s.reserve(["e"], [1], owner=2, group="42")  # type: ignore[arg-type]
    finally:
        s.close(flush=False)


# -- minor: misuse names the argument --------------------------------------------------------------
def test_misuse_of_slot_calls_names_the_argument() -> None:
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}).start()
    try:
        with pytest.raises(ValueError, match="1 sizes"):
            s.reserve(["x", "y"], [1])
        with pytest.raises(TypeError, match=r"reservations\[0\]"):
            s.commit([None])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"reservations\[1\]"):
            s.abort([s.reserve(["z"], [1])[0], 1])  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"leases\[0\]"):
            s.release([None])  # type: ignore[list-item]
        assert s.stats().slots.reservations == 1  # the abort ended nothing
    finally:
        s.close(flush=False)


def test_a_process_with_two_connections_holds_one_share_of_the_service_arena() -> None:
    """Through the node service: a client process (forked) reserves 16 x 1 MiB on each of two
    connections of a 16 MiB arena. Its connections share one share (8 MiB, not 8 each), so another
    client still gets room; the slots stay each connection's own (closing one reclaims its own)."""
    from store_backend.node import protocol as p
    from tests.store_backend.node.server_harness import Raw, cleanup_dir, service_config, service_thread, short_dir

    d = short_dir()
    cfg = service_config(d)
    report_r, report_w = os.pipe()
    hold_r, hold_w = os.pipe()
    try:
        with service_thread(cfg) as svc:
            pid = os.fork()
            if pid == 0:  # the stuck client: no threads of its own, raw frames only
                code = 1
                try:
                    os.close(report_r)
                    os.close(hold_w)
                    conns = [Raw(cfg["socket"]), Raw(cfg["socket"])]
                    counts = []
                    for n, c in enumerate(conns):
                        c.hello(want_segment=False, name=f"stuck-{n}")
                        grants = [c.ask(p.Reserve(0, [f"s{n}/{i}"], [MiB], None, 60.0)).grants[0] for i in range(16)]
                        counts.append(sum(g.status is Status.OK for g in grants))
                    os.write(report_w, f"{counts[0]} {counts[1]}\n".encode())
                    conns[1].close()  # its own tokens only
                    os.write(report_w, b"closed\n")
                    os.read(hold_r, 1)  # hold the rest until the test is done
                    code = 0
                finally:
                    os._exit(code)
            os.close(report_w)
            os.close(hold_r)
            with os.fdopen(report_r, "rb", buffering=0) as rep:
                counts = rep.read(64)
                while not counts.endswith(b"closed\n"):
                    more = rep.read(64)
                    assert more, "the client process ended early"
                    counts += more
                first, second = map(int, counts.split()[:2])
                assert first + second == 8, (first, second)  # one share for the process
                other = Raw(cfg["socket"])
                other.hello(want_segment=False, name="other engine")
                assert other.ask(p.Reserve(0, ["o/1"], [MiB], None, 60.0)).grants[0].status is Status.OK
                st = svc.store.stats().slots
                other.close()
                os.close(hold_w)
                _pid, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
                assert st.reservations == first + 1, st  # the closed connection's were reclaimed
    finally:
        cleanup_dir(d)


def test_a_key_whose_writer_died_with_it_reserved_is_abandoned_until_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """``abandoned``: what a peer's wait stops on. A reservation reclaimed because its owner's
    process exited marks its key; one aborted, expired, or reclaimed from a live owner does not
    (that writer may reserve the key again: a retried save). A new writer's reservation hides the
    mark while it writes, a commit clears it, a late reclaim of a reservation some other writer
    replaced marks nothing, and a mark lapses after ``ABANDONED_TTL_S``."""
    from store_backend.core import slot_calls
    from tests.store_backend.node.server_harness import wait_until

    s = TieredStore({"dram": {"capacity_bytes": 4 * MiB}}).start()
    try:
        assert not s.abandoned("never")
        (r,) = s.reserve(["a"], [SIZE], owner=7)
        assert not s.abandoned("a")  # being written
        s.abort([r], owner=7)
        assert not s.abandoned("a")  # aborted by a live writer
        s.reserve(["a"], [SIZE], owner=8)
        s.reclaim(8)  # a live owner's tokens declared void
        assert not s.abandoned("a")
        s.reserve(["a"], [SIZE], owner=9)
        s.reclaim(9, gone=True)  # that writer's process exited
        assert s.abandoned("a")
        (r,) = s.reserve(["a"], [SIZE])
        assert not s.abandoned("a")  # another writer took it up
        r.view[:] = tagged(1)
        assert s.commit([r]) == [Status.OK]
        assert not s.abandoned("a")  # stored
        assert s.remove(["a"]) == [Status.OK]
        assert not s.abandoned("a")  # removed after it was stored: not a given-up write
        # A reservation that expired, then another writer's commit, then the first owner's exit.
        s.reserve(["b"], [SIZE], owner=10, ttl_s=0.05)
        wait_until(lambda: s.exists(["b"], count_reserved=True) == 0, 10, "the reservation's expiry")
        assert not s.abandoned("b")  # expired: its writer may be slow, not gone
        (r,) = s.reserve(["b"], [SIZE])
        r.view[:] = tagged(2)
        assert s.commit([r]) == [Status.OK]
        s.reclaim(10, gone=True)
        assert s.remove(["b"]) == [Status.OK]
        assert not s.abandoned("b")  # the dead writer's reservation was no longer the key's
        s.reserve(["c"], [SIZE], owner=11)
        s.reclaim(11, gone=True)
        assert s.abandoned("c")
        monkeypatch.setattr(slot_calls, "ABANDONED_TTL_S", -1.0)  # every mark has lapsed
        assert not s.abandoned("c")
        assert not s.abandoned("") and not s.abandoned("x\x00")
    finally:
        s.close()
