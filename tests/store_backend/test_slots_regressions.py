"""Regressions of the slot API (reserve/lease/reclaim), each found by a review with a reproducer.

These need the embedded store's internals (a hook between two steps of a stage-in, the allocator's
books), so they run against :class:`~store_backend.store.TieredStore` only.
"""

from __future__ import annotations

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
    a = s._dram.allocator
    return a.used_bytes == sum(a.size_of(e.offset) for e in s._dram.entries.values())


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
            time.sleep(random.random() * 0.002)
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
