"""The slot API's contract: reserve -> write -> commit/abort, lease -> read -> release, reclaim.

Tests taking ``make_store`` run against every :class:`~store_backend.api.KVStore` implementation
(conftest.py); the others need the embedded store's internals (a gated SSD tier for a remove in
the middle of a stage-in, the arena's segment) and say so.

One difference is by design: the embedded store counts an arena share per ``owner``, the node
service per client *process* (every owner of a NodeClient, and its plain puts and gets, share
its process's one share; tests/store_backend/node/test_node_shares.py holds two processes to it).
The tests below that need a second share ask :func:`second_share` for one.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from store_backend.api import KVStore, Reservation, SegmentInfo, SlotLease, StoreClosedError
from store_backend.dram import SHM_DIR
from store_backend.node.client import NodeClient
from store_backend.core import slot_calls as slot_calls_module
from store_backend.store import TieredStore
from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.test_store_races import OBJ_BYTES, decode, gated_store, only_on_ssd, versioned

KiB = 1 << 10
MiB = 1 << 20
SIZE = 64 * KiB
DRAM = {"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"}}
MODEL_KEYS = st.sampled_from([f"key{i}" for i in range(5)])
MODEL_SIZES = st.sampled_from([1, 3000, 4096, 9000, 20000])
MODEL_MAX = 20000
OWNERS = st.sampled_from([0, 1, 2])


def write(r: Reservation, data: np.ndarray) -> None:
    assert r.status is Status.OK and r.view is not None and not r.view.readonly
    np.frombuffer(r.view, np.uint8)[:] = data


def read(ls: SlotLease) -> bytes:
    assert ls.status is Status.OK and ls.view is not None
    return bytes(ls.view)


def held(s: KVStore) -> tuple[int, int, int]:
    g = s.stats().slots
    return g.reservations, g.leases, g.held_bytes


def waiting_calls(s: KVStore) -> int:
    """Calls (a lease's wait_pending_s, an exists' wait_s) of other threads that wait in ``s``: on
    the embedded store's slot condition; the node service's, once it has received them (each
    test asks no lease or exists before its waits)."""
    if isinstance(s, TieredStore):
        return len(s._slot_changed._waiters)
    frames = s.service.frames  # type: ignore[attr-defined]  # the contract suite's served node
    return frames["lease"] + frames["exists"]


def test_a_reserved_key_is_invisible_until_commit(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    assert r.status is Status.OK and r.nbytes == SIZE and r.token > 0 and r.offset % 4096 == 0
    write(r, payload("k", SIZE))
    out = np.zeros(SIZE, np.uint8)
    assert s.contains(["k"]) == [False] and s.exists(["k"]) == 0 and s.size_of(["k"]) == [None]
    assert s.tier_of(["k"]) == [None] and "k" not in s.keys()
    assert s.get_into(["k"], [out])[0].status is Status.NOT_FOUND
    assert s.lease(["k"])[0].status is Status.NOT_FOUND
    assert s.exists(["k"], count_reserved=True) == 1  # a save in flight counts where asked to
    assert s.exists_all([["k"]], count_reserved=True) == 1 and s.exists_all([["k"]]) == 0
    assert s.commit([r]) == [Status.OK]
    assert s.contains(["k"]) == [True] and s.exists(["k"]) == 1 and s.size_of(["k"]) == [SIZE]
    assert s.get_into(["k"], [out])[0] == (Status.OK, SIZE) and np.array_equal(out, payload("k", SIZE))
    assert held(s) == (0, 0, 0)
    assert s.commit([r]) == [Status.IO_ERROR]  # a used token: no effect
    assert s.stats().store.slot_commits == 1


def test_a_second_reserve_or_put_of_a_reserved_key_answers_exists(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    assert s.reserve(["k"], [SIZE])[0].status is Status.EXISTS
    assert s.put(["k"], [payload("other", SIZE)]) == [Status.EXISTS]
    write(r, payload("k", SIZE))
    assert s.commit([r]) == [Status.OK]
    out = np.zeros(SIZE, np.uint8)
    assert s.get_into(["k"], [out])[0].status is Status.OK and np.array_equal(out, payload("k", SIZE))
    assert s.reserve(["k"], [SIZE])[0].status is Status.EXISTS  # stored: immutable


def test_reserve_answers_per_key_and_refuses_misuse(make_store) -> None:
    s = make_store(DRAM)
    got = s.reserve(["", "big", "ok"], [8, 2 * MiB, 8])
    assert [g.status for g in got] == [Status.INVALID_KEY, Status.TOO_LARGE, Status.OK]
    assert got[0].token == 0 and got[0].view is None
    s.abort(got)
    with pytest.raises(ValueError, match="sizes"):
        s.reserve(["a"], [-1])
    with pytest.raises(ValueError, match="keys"):
        s.reserve(["a", "b"], [1])
    with pytest.raises(ValueError, match="ttl_s"):
        s.reserve(["a"], [1], ttl_s=float("inf"))
    with pytest.raises(ValueError, match="wait_s"):
        s.exists(["a"], wait_s=-1)
    with pytest.raises(ValueError, match="wait_pending_s"):
        s.lease(["a"], wait_pending_s=float("nan"))
    assert held(s) == (0, 0, 0)


def second_share(s: KVStore) -> bool:
    """Whether another ``owner`` of ``s`` counts against a share of its own (embedded: yes; the
    node service: no, its shares are per client process)."""
    return not isinstance(s, NodeClient)


def test_abort_frees_the_slot_and_the_key(make_store) -> None:
    s = make_store(DRAM)
    half = 512 * KiB  # each owner may hold half the arena: two owners fill it
    [r] = s.reserve(["k"], [half], owner=1)
    assert r.status is Status.OK
    if second_share(s):
        [full] = s.reserve(["other"], [half], owner=2)
        assert full.status is Status.OK
        assert s.reserve(["third"], [SIZE], owner=3)[0].status is Status.NO_SPACE  # nothing evictable
    else:  # one share: the process holds half the arena already
        assert s.reserve(["other"], [SIZE], owner=2)[0].status is Status.NO_SPACE
    write(r, np.full(half, 7, np.uint8))
    s.abort([r], owner=1)
    assert s.contains(["k"]) == [False] and held(s)[0] == (1 if second_share(s) else 0)
    assert s.commit([r], owner=1) == [Status.IO_ERROR]  # aborted: nothing to commit
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]  # the key is free, and so is the room
    out = np.zeros(SIZE, np.uint8)
    assert s.get_into(["k"], [out])[0].status is Status.OK and np.array_equal(out, payload("k", SIZE))
    if second_share(s):
        s.abort([full], owner=2)
    assert held(s) == (0, 0, 0) and s.stats().store.slot_aborts == (2 if second_share(s) else 1)


def test_a_lease_survives_remove_and_its_bytes_stay_intact_until_release(make_store) -> None:
    s = make_store(DRAM)
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    [ls] = s.lease(["k"])
    assert ls.status is Status.OK and ls.nbytes == SIZE and ls.view is not None and ls.view.readonly
    assert s.remove(["k"]) == [Status.OK]
    assert s.contains(["k"]) == [False] and s.lease(["k"])[0].status is Status.NOT_FOUND
    assert s.put(["k"], [payload("new", SIZE)]) == [Status.OK]  # a new object, elsewhere
    for i in range(40):  # more than the arena holds: everything unleased is evicted meanwhile
        assert s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)]) == [Status.OK]
    assert read(ls) == payload("k", SIZE).tobytes()
    assert s.release([ls]) == [True]
    assert s.release([ls]) == [False]  # once
    assert held(s) == (0, 0, 0)
    # The removed object's room is free again: the arena fills with 16 objects of SIZE.
    for i in range(40, 56):
        assert s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)]) == [Status.OK]


def test_a_lease_keeps_its_object_from_eviction(make_store) -> None:
    s = make_store(DRAM)
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    [ls] = s.lease(["k"])
    for i in range(40):
        assert s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)]) == [Status.OK]
    assert s.contains(["k"]) == [True] and read(ls) == payload("k", SIZE).tobytes()
    assert s.release([ls]) == [True]


def test_release_after_expiry_is_false(make_store) -> None:
    s = make_store(DRAM)
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    [ls] = s.lease(["k"], ttl_s=0.05)
    time.sleep(0.15)  # past the lease's TTL
    assert read(ls) == payload("k", SIZE).tobytes()  # still held: bytes never reused under a reader
    assert s.stats().slots.expired_held_bytes >= SIZE
    assert s.release([ls]) == [False]
    assert held(s) == (0, 0, 0) and s.stats().store.slot_expired == 1


def test_commit_after_expiry_is_io_error_and_the_key_is_free_for_another_writer(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE], ttl_s=0.05)
    write(r, payload("stale", SIZE))
    time.sleep(0.15)  # past the reservation's TTL
    [r2] = s.reserve(["k"], [SIZE])  # the expired reservation no longer holds the key
    assert r2.status is Status.OK and r2.offset != r.offset
    write(r2, payload("k", SIZE))
    assert s.commit([r]) == [Status.IO_ERROR]
    assert s.commit([r2]) == [Status.OK]
    out = np.zeros(SIZE, np.uint8)
    assert s.get_into(["k"], [out])[0].status is Status.OK and np.array_equal(out, payload("k", SIZE))
    st = s.stats()
    assert st.store.slot_expired == 1 and st.slots.held_bytes == 0


def test_an_expired_reservation_frees_its_key_for_put_and_for_lookups(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE], ttl_s=0.05)
    assert s.exists(["k"], count_reserved=True) == 1
    time.sleep(0.15)  # past the reservation's TTL
    assert s.exists(["k"], count_reserved=True) == 0  # a save that can no longer commit
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    assert s.commit([r]) == [Status.IO_ERROR]
    out = np.zeros(SIZE, np.uint8)
    assert s.get_into(["k"], [out])[0].status is Status.OK and np.array_equal(out, payload("k", SIZE))


def test_an_expired_slot_is_never_handed_out_again_before_reclaim(make_store) -> None:
    s = make_store(DRAM)
    owner = 11
    [r] = s.reserve(["slow"], [SIZE], ttl_s=0.05, owner=owner)
    [pre] = s.reserve(["leased"], [SIZE], owner=owner)
    write(pre, payload("leased", SIZE))
    assert s.commit([pre], owner=owner) == [Status.OK]
    [ls] = s.lease(["leased"], ttl_s=0.05, owner=owner)
    marker = np.full(SIZE, 0xA5, np.uint8)
    write(r, marker)  # the stalled writer's bytes
    time.sleep(0.15)  # past the TTLs
    # Fill the arena over and over: no put, reservation or lease may land on the expired slots.
    offsets = set()
    for i in range(64):
        [g] = s.reserve([f"fill{i}"], [SIZE])
        if g.status is Status.OK:
            offsets.add(g.offset)
            write(g, payload(f"fill{i}", SIZE))
            assert s.commit([g]) == [Status.OK]
        assert s.put([f"put{i}"], [payload(f"put{i}", SIZE)])[0] in (Status.OK, Status.NO_SPACE)
    assert r.offset not in offsets and ls.offset not in offsets
    assert np.array_equal(np.frombuffer(r.view, np.uint8), marker)  # nobody wrote over it
    assert read(ls) == payload("leased", SIZE).tobytes()
    assert s.stats().slots.expired_held_bytes == 2 * SIZE
    assert s.reclaim(owner) == (1, 1)
    assert held(s) == (0, 0, 0) and s.stats().slots.expired_held_bytes == 0
    # Now the room is free: 16 new objects of SIZE are in DRAM at once (the arena holds 16).
    after = [f"after{i}" for i in range(16)]
    assert s.put(after, [payload(k, SIZE) for k in after]) == [Status.OK] * 16
    assert s.contains(after) == [True] * 16


def test_reclaim_ends_every_token_of_an_owner_and_only_those(make_store) -> None:
    s = make_store(DRAM)
    assert s.put(["a", "b"], [payload("a", SIZE), payload("b", SIZE)]) == [Status.OK] * 2
    mine = s.reserve(["x", "y"], [SIZE, SIZE], owner=7)
    leases = s.lease(["a", "b"], owner=7)
    other = s.reserve(["z"], [SIZE], owner=8)
    assert [x.status for x in [*mine, *leases, *other]] == [Status.OK] * 5
    assert s.reclaim(7) == (2, 2)
    assert s.reclaim(7) == (0, 0)
    assert s.commit(mine, owner=7) == [Status.IO_ERROR] * 2
    assert s.release(leases, owner=7) == [False, False]
    assert s.contains(["x", "y"]) == [False, False] and s.contains(["a", "b"]) == [True, True]
    assert held(s) == (1, 0, SIZE)
    write(other[0], payload("z", SIZE))
    assert s.commit(other, owner=8) == [Status.OK]
    st = s.stats().store
    if isinstance(s, NodeClient):  # the client ends them for its owner: aborts and releases
        assert (st.slot_aborts, st.slot_releases) == (2, 2)
    else:
        assert st.slot_reclaimed == 4


def test_an_owner_may_hold_at_most_its_share_of_the_arena(make_store) -> None:
    s = make_store(DRAM)  # 1 MiB: an owner may hold 512 KiB
    got = s.reserve([f"r{i}" for i in range(9)], [SIZE] * 9, owner=3)
    assert [g.status for g in got] == [Status.OK] * 8 + [Status.NO_SPACE]
    assert s.lease(["anything"], owner=3)[0].status is Status.NOT_FOUND
    if not second_share(s):
        # The process's one share is held: its put is refused too, and stores once a slot is back;
        # then its leases count against the same share.
        assert s.put(["p"], [payload("p", SIZE)]) == [Status.NO_SPACE]
        s.abort(got[:1], owner=3)
        assert s.put(["p"], [payload("p", SIZE)]) == [Status.OK]
        [ls] = s.lease(["p"], owner=3)
        assert ls.status is Status.OK
        assert s.lease(["p"], owner=4)[0].status is Status.NO_SPACE  # a lease counts too
        assert s.stats().store.slot_refused == 3
        assert s.reclaim(3) == (7, 1)
        return
    assert s.put(["p"], [payload("p", SIZE)]) == [Status.OK]
    assert s.lease(["p"], owner=3)[0].status is Status.NO_SPACE  # a lease counts too
    [theirs] = s.lease(["p"], owner=4)  # another owner is not held up
    assert theirs.status is Status.OK
    assert s.release([theirs], owner=4) == [True]
    s.abort(got[:1], owner=3)
    [ls] = s.lease(["p"], owner=3)
    assert ls.status is Status.OK
    assert s.stats().store.slot_refused == 2
    assert s.reclaim(3) == (7, 1)


def test_a_token_of_another_owner_or_an_unknown_one_has_no_effect(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE], owner=1)
    write(r, payload("k", SIZE))
    assert s.commit([r], owner=2) == [Status.IO_ERROR]
    s.abort([r], owner=2)
    assert s.commit([Reservation(Status.OK, "k", SIZE, r.token + 1000, r.offset, None)], owner=1) == [Status.IO_ERROR]
    assert s.contains(["k"]) == [False] and s.reserve(["k"], [SIZE])[0].status is Status.EXISTS
    assert s.commit([r], owner=1) == [Status.OK]
    [ls] = s.lease(["k"], owner=1)
    assert s.release([ls], owner=2) == [False]
    assert s.release([SlotLease(Status.OK, "k", SIZE, ls.token + 1000, ls.offset, None)], owner=1) == [False]
    assert s.reclaim(2) == (0, 0)
    assert held(s) == (0, 1, SIZE)
    assert s.release([ls], owner=1) == [True]
    assert s.stats().store.slot_foreign == 5


def test_a_remove_of_a_reserved_key_wins_and_commit_answers_ok(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    assert s.remove(["k"]) == [Status.OK]  # the reservation was taken
    write(r, payload("k", SIZE))
    assert s.commit([r]) == [Status.OK]  # as a put racing the remove answers
    assert s.contains(["k"]) == [False] and held(s) == (0, 0, 0)


def test_lease_waits_for_a_pending_key_to_commit(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    got: list[SlotLease] = []
    t = threading.Thread(target=lambda: got.extend(s.lease(["k"], wait_pending_s=10)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)  # the window in which the lease must not return
    assert not got
    write(r, payload("k", SIZE))
    assert s.commit([r]) == [Status.OK]
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert read(got[0]) == payload("k", SIZE).tobytes()
    assert s.release(got) == [True]


def test_a_lease_ttl_starts_when_the_lease_is_granted_not_before_its_wait(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    got: list[SlotLease] = []
    t = threading.Thread(target=lambda: got.extend(s.lease(["k"], ttl_s=0.5, wait_pending_s=10)))
    t.start()
    time.sleep(0.8)  # longer than the lease's TTL
    write(r, payload("k", SIZE))
    assert s.commit([r]) == [Status.OK]
    t.join(10)
    assert read(got[0]) == payload("k", SIZE).tobytes()
    assert s.release(got) == [True]  # released well within 0.5 s of the grant


def test_lease_waiting_for_a_pending_key_that_is_aborted_answers_not_found(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    got: list[SlotLease] = []
    t = threading.Thread(target=lambda: got.extend(s.lease(["k"], wait_pending_s=10)))
    t0 = time.monotonic()
    t.start()
    wait_until(lambda: waiting_calls(s) == 1, 10, "the lease waiting")
    s.abort([r])
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert got[0].status is Status.NOT_FOUND
    assert s.lease(["absent"], wait_pending_s=0.2)[0].status is Status.NOT_FOUND  # nothing to wait for


@pytest.mark.parametrize("end", ["remove", "expire", "reclaim"])
def test_a_wait_for_a_pending_key_ends_when_the_reservation_does(make_store, monkeypatch, end) -> None:
    """Woken by the event itself: the waits' periodic backstop is pushed out of reach."""
    monkeypatch.setattr(slot_calls_module, "_WAIT_SLICE_S", 60.0)
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE], ttl_s=0.5 if end == "expire" else 60, owner=1)
    got: list[SlotLease] = []
    t = threading.Thread(target=lambda: got.extend(s.lease(["k"], wait_pending_s=30)))
    t0 = time.monotonic()
    t.start()
    wait_until(lambda: waiting_calls(s) == 1, 10, "the lease waiting")
    if end == "remove":
        assert s.remove(["k"]) == [Status.OK]
    elif end == "reclaim":
        assert s.reclaim(1) == (1, 0)
    else:  # the service's timer expires tokens
        time.sleep(max(0.0, t0 + 0.7 - time.monotonic()))  # past the reservation's 0.5 s TTL
        s.expire_slots() if hasattr(s, "expire_slots") else s.exists(["k"], count_reserved=True)
    t.join(20)
    assert not t.is_alive() and time.monotonic() - t0 < 15
    assert got[0].status is Status.NOT_FOUND


def test_exists_waits_for_commits(make_store) -> None:
    s = make_store(DRAM)
    answers: list[int] = []
    t = threading.Thread(target=lambda: answers.append(s.exists(["a", "b"], wait_s=10)))
    t0 = time.monotonic()
    t.start()
    [ra, rb] = s.reserve(["a", "b"], [SIZE, SIZE])
    write(ra, payload("a", SIZE))
    assert s.commit([ra]) == [Status.OK]
    time.sleep(0.2)  # the window in which the exists must not return
    assert not answers  # one of two committed: still waiting
    write(rb, payload("b", SIZE))
    assert s.commit([rb]) == [Status.OK]
    t.join(10)
    assert answers == [2] and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    assert s.exists(["a", "never"], wait_s=0.3) == 1
    assert 0.25 <= time.monotonic() - t0 < 5


def test_exists_all_is_the_shortest_leading_run(make_store) -> None:
    s = make_store(DRAM)
    assert s.put(["a0", "a1", "b0"], [payload(k, 16) for k in ("a0", "a1", "b0")]) == [Status.OK] * 3
    assert s.exists_all([["a0", "a1", "a2"], ["b0", "b1"]]) == 1
    assert s.exists_all([["a0", "a1"]]) == 2
    assert s.exists_all([["a0"], []]) == 0
    assert s.exists_all([]) == 0
    [r] = s.reserve(["b1"], [16])
    assert s.exists_all([["a0", "a1"], ["b0", "b1"]]) == 1
    assert s.exists_all([["a0", "a1"], ["b0", "b1"]], count_reserved=True) == 2
    s.abort([r])


def test_layer_views_are_ranges_of_the_slot(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    for layer in range(4):
        np.frombuffer(r.layer(layer * SIZE // 4, (layer + 1) * SIZE // 4), np.uint8)[:] = layer
    with pytest.raises(ValueError, match="outside"):
        r.layer(0, SIZE + 1)
    assert s.commit([r]) == [Status.OK]
    [ls] = s.lease(["k"])
    assert [bytes(ls.layer(i * SIZE // 4, i * SIZE // 4 + 1)) for i in range(4)] == [bytes([i]) for i in range(4)]
    assert s.release([ls]) == [True]


def test_a_committed_slot_is_covered_by_flush_and_offloaded(make_store, tmp_path) -> None:
    s = make_store({**DRAM, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB,
                                    "admission_policy": "all"}})
    [r] = s.reserve(["k"], [SIZE])
    write(r, payload("k", SIZE))
    assert s.commit([r]) == [Status.OK]
    deadline = time.monotonic() + 20
    while s.stats().dram.offloads < 1:  # eager offload queued by the commit, as by a put
        assert time.monotonic() < deadline, "the committed object was never offloaded"
        time.sleep(0.02)  # poll interval; the loop has a deadline
    [r2] = s.reserve(["k2"], [SIZE])
    write(r2, payload("k2", SIZE))
    assert s.commit([r2]) == [Status.OK]
    report = s.flush_report(timeout_s=30)
    assert report.ok, report.summary()
    assert s.remove(["k"]) == [Status.OK]
    assert s.contains(["k"]) == [False]


def test_lease_stages_in_an_object_only_on_ssd(make_store, tmp_path) -> None:
    s = make_store({**DRAM, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB,
                                    "admission_policy": "all"}, "promotion": {"enabled": False}})
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    assert s.flush(timeout_s=30)
    for i in range(24):
        s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)])
        assert s.flush(timeout_s=30)
    assert s.tier_of(["k"]) == ["ssd"]
    assert s.lease(["k"], stage_in=False)[0].status is Status.NOT_FOUND
    [ls] = s.lease(["k"])
    assert read(ls) == payload("k", SIZE).tobytes()
    assert s.tier_of(["k"]) == ["ssd"]  # a transient slot: not promoted (promotion is off)
    assert s.remove(["k"]) == [Status.OK]
    for i in range(24, 48):  # more than DRAM holds: every slot not held is written over
        s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)])
    assert read(ls) == payload("k", SIZE).tobytes()  # held by the lease
    assert s.release([ls]) == [True]
    assert held(s) == (0, 0, 0) and s.stats().store.slot_stage_ins == 1


@pytest.mark.parametrize("promote", [False, True])
def test_a_key_named_twice_in_one_lease_is_leased_twice(make_store, tmp_path, promote) -> None:
    s = make_store({**DRAM, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB,
                                    "admission_policy": "all"},
                    "promotion": {"enabled": promote, "admission_hits": 1}})
    assert s.put(["k", "d"], [payload("k", SIZE), payload("d", SIZE)]) == [Status.OK] * 2
    assert s.flush(timeout_s=30)
    for i in range(24):
        s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)])
        assert s.flush(timeout_s=30)
    assert s.tier_of(["k"]) == ["ssd"]
    leases = s.lease(["k", "k", "d", "k"])
    assert [read(ls) for ls in leases] == [payload(k, SIZE).tobytes() for k in ("k", "k", "d", "k")]
    assert s.release(leases) == [True] * 4
    assert held(s) == (0, 0, 0)


def test_a_stage_in_that_promotes_makes_the_slot_the_dram_copy(tmp_path) -> None:
    """Embedded (the promotion rule is the store's): admission_hits=1 promotes at the first read."""
    s, _gate = gated_store(tmp_path)
    try:
        only_on_ssd(s, "x")
        [ls] = s.lease(["x"])
        assert ls.status is Status.OK and decode(np.frombuffer(ls.view, np.uint8)) == (0, 1)
        assert s.tier_of(["x"]) == ["dram"]
        assert s.release([ls]) == [True]
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert s.get_into(["x"], [out])[0].status is Status.OK and decode(out) == (0, 1)
    finally:
        s.close()


def test_a_stage_in_evicts_only_clean_objects(make_store, tmp_path) -> None:
    """DRAM full of objects not yet on SSD: a stage-in has no room (NO_SPACE: the engine
    recomputes) rather than dropping an object's only copy; once they are persisted it has."""
    s = make_store({**DRAM, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB,
                                    "admission_policy": "all"},
                    "offload": {"policy": "watermark", "high_watermark": 1.0, "low_watermark": 0.9},
                    "promotion": {"enabled": False}})
    assert s.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    assert s.flush(timeout_s=30)
    fills = [f"fill{i}" for i in range(16)]
    assert s.put(fills, [payload(f, SIZE) for f in fills]) == [Status.OK] * 16  # k (clean) made room
    assert s.tier_of(["k"]) == ["ssd"]
    [ls] = s.lease(["k"])
    assert ls.status is Status.NO_SPACE
    assert s.contains(fills) == [True] * 16 and s.stats().store.dropped_unpersisted == 0
    assert s.flush(timeout_s=30)  # now every fill is on SSD too: clean, evictable
    [ls] = s.lease(["k"])
    assert read(ls) == payload("k", SIZE).tobytes()
    assert s.release([ls]) == [True]


def test_an_owner_may_hold_at_most_65536_tokens(make_store) -> None:
    # A token counts its whole block (64 bytes here): 65536 of them hold 4 MiB of an 8 MiB share.
    s = make_store({"dram": {"capacity_bytes": 16 * MiB, "alignment_bytes": 64}})
    assert s.put(["k"], [payload("k", 16)]) == [Status.OK]
    leases = s.lease(["k"] * 65537, owner=5)
    assert [ls.status for ls in leases[-2:]] == [Status.OK, Status.NO_SPACE]
    other = s.lease(["k"], owner=6)[0].status
    assert other is (Status.OK if second_share(s) else Status.NO_SPACE)  # another owner's share, if any
    assert s.release(leases[:1], owner=5) == [True]
    assert s.lease(["k"], owner=5)[0].status is Status.OK
    assert s.reclaim(5) == (0, 65536) and s.reclaim(6) == (0, 1 if second_share(s) else 0)
    assert held(s) == (0, 0, 0)


def test_close_ends_waits_for_commits(make_store) -> None:
    s = make_store(DRAM)
    [r] = s.reserve(["k"], [SIZE])
    raised: list[str] = []

    def wait(call) -> None:  # noqa: ANN001
        try:
            call()
        except StoreClosedError:
            raised.append("closed")

    waiters = [threading.Thread(target=wait, args=(lambda: s.exists(["k"], wait_s=60),)),
               threading.Thread(target=wait, args=(lambda: s.lease(["k"], wait_pending_s=60),))]
    for t in waiters:
        t.start()
    wait_until(lambda: waiting_calls(s) == 2, 10, "both calls waiting")
    t0 = time.monotonic()
    s.close(flush=False, timeout_s=30)
    for t in waiters:
        t.join(30)
    assert not any(t.is_alive() for t in waiters) and time.monotonic() - t0 < 10
    assert raised == ["closed", "closed"]
    assert r.status is Status.OK


@pytest.mark.parametrize("failure", [Status.CORRUPT, Status.IO_ERROR, "raises"])
def test_a_stage_in_whose_read_fails_answers_the_failure_and_frees_its_slot(tmp_path, failure) -> None:
    """Embedded, with a fault injected under the SSD tier: the read answers ``failure`` (or raises)
    once; the lease answers that failure (IO_ERROR when it raised), holds nothing, counts it as the
    tier's failure, and the next lease reads the object."""
    s, gate = gated_store(tmp_path)
    try:
        only_on_ssd(s, "x")
        real = gate.get_into
        fails = [failure]

        def failing_get_into(keys, buffers):  # noqa: ANN001, ANN202
            if "x" in keys and fails:
                f = fails.pop()
                if f == "raises":
                    raise OSError("injected")
                return [ReadResult(f)] * len(keys)
            return real(keys, buffers)

        gate.get_into = failing_get_into
        [ls] = s.lease(["x"])
        assert ls.status is (Status.IO_ERROR if failure == "raises" else failure) and ls.view is None
        assert held(s) == (0, 0, 0) and s.tier_of(["x"]) == ["ssd"]
        m = s.metrics()["ssd"]["failures"]
        assert m["checksum" if failure is Status.CORRUPT else "io_error"] == 1, m
        [ls] = s.lease(["x"])
        assert decode(np.frombuffer(ls.view, np.uint8)) == (0, 1)
        assert s.release([ls]) == [True]
    finally:
        s.close()


@pytest.mark.parametrize("method", ["get_into", "size_of"])
def test_a_stage_in_racing_a_remove_never_serves_the_removed_bytes(tmp_path, method) -> None:
    """Embedded, with the SSD tier gated: the stage-in's size lookup or read stops after the real
    call; a remove runs to completion meanwhile; then the lease goes on. It must answer NOT_FOUND,
    free its slot, and the key must then store new bytes."""
    s, gate = gated_store(tmp_path, method, "leaser", after=True)
    try:
        only_on_ssd(s, "x")
        got: list[SlotLease] = []
        t = threading.Thread(target=lambda: got.extend(s.lease(["x"])), name="leaser")
        t.start()
        assert gate.entered.wait(30)
        assert s.remove(["x"]) == [Status.OK]
        gate.release.set()
        t.join(30)
        assert not t.is_alive()
        assert got[0].status is Status.NOT_FOUND and got[0].view is None
        assert held(s) == (0, 0, 0)
        assert s.contains(["x"]) == [False]
        assert s.put(["x"], [versioned(0, 2)]) == [Status.OK]
        [ls] = s.lease(["x"])
        assert decode(np.frombuffer(ls.view, np.uint8)) == (0, 2)
        assert s.release([ls]) == [True]
    finally:
        gate.release.set()
        s.close()


def test_many_threads_mixing_slots_with_put_get_and_remove_never_see_wrong_bytes(make_store, tmp_path) -> None:
    """Every object is self-verifying (key index and version in a checksummed header): whatever a
    lease or get answers OK for must be a whole object of that key, of a version that was
    committed. Writers use reserve/commit (sometimes aborting) and put; readers lease/release and
    get_into; a remover removes. Expiries happen too (short TTLs). At the end no token is held."""
    s = make_store({"dram": {"capacity_bytes": 256 * KiB, "eviction_policy": "lru"},
                    "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "admission_policy": "all"},
                    "promotion": {"admission_hits": 2}})
    nkeys, size = 24, 16 * KiB
    stop = time.monotonic() + float(os.environ.get("RACE_SECONDS", "3"))
    committed: dict[int, set[int]] = {i: set() for i in range(nkeys)}
    lock = threading.Lock()
    errors: list[str] = []
    versions = iter(range(1, 1 << 30))

    def check(buf: np.ndarray, i: int, what: str) -> None:
        got = decode(buf)
        with lock:
            ok = got is not None and got[0] == i and got[1] in committed[i] | pending
        if not ok:
            errors.append(f"{what} of key {i} read {got}")

    pending: set[int] = set()  # versions being committed right now (a reader may see them first)

    def writer(owner: int) -> None:
        rng = random.Random(owner)
        while time.monotonic() < stop and not errors:
            i = rng.randrange(nkeys)
            with lock:
                v = next(versions)
            data = versioned(i, v, size)
            if rng.random() < 0.3:
                with lock:
                    pending.add(v)
                st = s.put([f"k{i}"], [data])[0]
                with lock:
                    pending.discard(v)
                    if st is Status.OK:
                        committed[i].add(v)
                continue
            [r] = s.reserve([f"k{i}"], [size], ttl_s=0.05 if rng.random() < 0.05 else 30, owner=owner)
            if r.status is not Status.OK:
                continue
            np.frombuffer(r.view, np.uint8)[:] = data
            if rng.random() < 0.2:
                s.abort([r], owner=owner)
                continue
            if rng.random() < 0.05:
                time.sleep(0.08)  # past a short TTL
            with lock:
                pending.add(v)
            st = s.commit([r], owner=owner)[0]
            with lock:
                pending.discard(v)
                if st is Status.OK:
                    committed[i].add(v)

    def reader(owner: int) -> None:
        rng = random.Random(owner)
        out = np.zeros(size, np.uint8)
        while time.monotonic() < stop and not errors:
            keys = rng.sample(range(nkeys), 3)
            if rng.random() < 0.5:
                leases = s.lease([f"k{i}" for i in keys], ttl_s=0.05 if rng.random() < 0.05 else 30,
                                 wait_pending_s=0.01 if rng.random() < 0.2 else 0.0, owner=owner)
                copies = [None if ls.status is not Status.OK else np.frombuffer(ls.view, np.uint8).copy()
                          for ls in leases]
                if rng.random() < 0.05:
                    time.sleep(0.08)  # past a short TTL
                stable = s.release(leases, owner=owner)
                for i, ls, c, ok in zip(keys, leases, copies, stable):
                    assert (ls.status is Status.OK) == (c is not None)
                    if c is not None and ok:
                        check(c, i, "lease")
            else:
                for i in keys:
                    res = s.get_into([f"k{i}"], [out])[0]
                    if res.status is Status.OK:
                        check(out, i, "get")

    def remover() -> None:
        rng = random.Random(99)
        while time.monotonic() < stop and not errors:
            s.remove([f"k{rng.randrange(nkeys)}"])
            time.sleep(0.002)  # the remover's pace

    threads = [threading.Thread(target=writer, args=(o,)) for o in (1, 2)]
    threads += [threading.Thread(target=reader, args=(o,)) for o in (3, 4)]
    threads.append(threading.Thread(target=remover))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    for o in (1, 2, 3, 4):
        s.reclaim(o)
    g = s.stats()
    assert (g.slots.reservations, g.slots.leases, g.slots.held_bytes) == (0, 0, 0)
    assert g.store.slot_commits > 0 and g.store.slot_leases > 0 and g.store.slot_stage_ins > 0, g.store
    # Everything left is a whole committed object of its key.
    out = np.zeros(size, np.uint8)
    for i in range(nkeys):
        if s.get_into([f"k{i}"], [out])[0].status is Status.OK:
            check(out, i, "final get")
    assert not errors, errors[:5]


def test_commits_and_stage_ins_publish_residency_events(tmp_path) -> None:
    """Embedded (the bus is the store's): a commit publishes ``stored`` as a put does, a promoting
    stage-in ``moved`` (ssd -> dram), an abort nothing."""
    s, _gate = gated_store(tmp_path)
    try:
        only_on_ssd(s, "x")
        events: list = []
        s.subscribe(events.extend)
        [r, a] = s.reserve(["c", "a"], [OBJ_BYTES, OBJ_BYTES])
        np.frombuffer(r.view, np.uint8)[:] = versioned(5, 1)
        assert s.commit([r]) == [Status.OK]
        s.abort([a])
        [ls] = s.lease(["x"])
        assert s.release([ls]) == [True]
        assert s.wait_idle(10, offload=False, promotion=False)
        seen = [(e.kind, e.key, e.tier, e.src_tier) for e in events if e.key in ("c", "a", "x")]
        assert ("stored", "c", "dram", None) in seen and ("moved", "x", "dram", "ssd") in seen
        assert not [e for e in seen if e[1] == "a"]
    finally:
        s.close()


# -- the arena's shared segment (embedded: a TieredStore constructor keyword) ---------------------

def test_a_private_arena_has_no_segment() -> None:
    with TieredStore(DRAM) as s:
        assert s.segment() is None
        with pytest.raises(OSError):
            s.open_segment_fd()


def test_a_fresh_segment_is_a_new_file_every_start_and_leftovers_are_unlinked(tmp_path) -> None:
    name = f"mkv-slots-test-{os.getpid()}"
    dead = os.path.join(SHM_DIR, f"{name}-123")  # an owner that exited left it: its lock is free
    alive = os.path.join(SHM_DIR, f"{name}-456")  # a live owner holds its lock
    other = os.path.join(SHM_DIR, f"{name}-x-789")  # another name's segment
    for p in (dead, alive, other):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    holder = os.open(alive, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    cfg = {"dram": {"capacity_bytes": 1 * MiB, "shm_name": name}}
    try:
        with TieredStore(cfg, fresh_segment=True) as s:
            info = s.segment()
            assert isinstance(info, SegmentInfo)
            assert info.path.startswith(os.path.join(SHM_DIR, name + "-")) and info.nbytes == MiB
            assert info.alignment_bytes == 4096
            st = os.stat(info.path)
            assert (st.st_dev, st.st_ino) == (info.dev, info.ino) and st.st_mode & 0o777 == 0o600
            assert not os.path.exists(dead) and os.path.exists(alive) and os.path.exists(other)
            # A descriptor for a client: the same file, a separate open file (not the lock's).
            fd = s.open_segment_fd()
            try:
                assert os.fstat(fd).st_ino == info.ino
                m = mmap.mmap(fd, MiB)
                [r] = s.reserve(["k"], [SIZE])
                write(r, payload("k", SIZE))
                assert s.commit([r]) == [Status.OK]
                [ls] = s.lease(["k"])
                assert m[ls.offset:ls.offset + SIZE] == payload("k", SIZE).tobytes()  # the client's view
                assert s.release([ls]) == [True]
                m.close()
            finally:
                os.close(fd)
            first = info
        with TieredStore(cfg, fresh_segment=True) as s2:
            second = s2.segment()
            assert second is not None and second.path != first.path
        assert not os.path.exists(first.path) and not os.path.exists(second.path)
    finally:
        os.close(holder)
        for p in (dead, alive, other):
            if os.path.exists(p):
                os.unlink(p)


def test_another_process_writes_and_reads_slots_through_the_segment_fd() -> None:
    """What the node service hands a client (an fd of the segment, an offset and a size per slot)
    is enough: a child process maps the fd, fills a reserved slot and copies a leased one out."""
    name = f"mkv-slots-xproc-{os.getpid()}"
    with TieredStore({"dram": {"capacity_bytes": 1 * MiB, "shm_name": name}}, fresh_segment=True) as s:
        assert s.put(["src"], [payload("src", SIZE)]) == [Status.OK]
        [r] = s.reserve(["dst"], [SIZE], owner=9)
        [ls] = s.lease(["src"], owner=9)
        fd = s.open_segment_fd()
        child = (
            "import mmap, os, sys\n"
            "fd, size, w_off, r_off, n = map(int, sys.argv[1:])\n"
            "m = mmap.mmap(fd, size)\n"
            "m[w_off:w_off + n] = m[r_off:r_off + n][::-1]\n"  # write the leased bytes reversed
            "m.close()\n")
        try:
            proc = subprocess.run([sys.executable, "-c", child, str(fd), str(MiB), str(r.offset), str(ls.offset),
                                   str(SIZE)], pass_fds=[fd], capture_output=True, text=True, timeout=60)
        finally:
            os.close(fd)
        assert proc.returncode == 0, proc.stderr
        assert s.release([ls], owner=9) == [True]
        assert s.commit([r], owner=9) == [Status.OK]
        out = np.zeros(SIZE, np.uint8)
        assert s.get_into(["dst"], [out])[0].status is Status.OK
        assert np.array_equal(out, payload("src", SIZE)[::-1])


def test_a_fresh_segment_needs_a_name() -> None:
    from store_backend.config import ConfigError

    with pytest.raises(ConfigError, match="dram.shm_name"):
        TieredStore(DRAM, fresh_segment=True)


# -- a model of the slot API (hypothesis stateful testing; embedded) -------------------------------

class SlotsVersusDict(RuleBasedStateMachine):
    """Reserve/commit/abort, lease/release, put, get and remove in any order against a dict model,
    over a DRAM tier of room for a few objects above an SSD tier (so stage-ins and evictions
    happen). The store is a cache and may lose an object; it must never serve bytes other than the
    key's current value, show a reserved key before its commit, or change a leased object's bytes
    before its release."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="slots-model-")
        self.store = TieredStore({
            "dram": {"capacity_bytes": 96 * KiB, "eviction_policy": "lru"},
            "ssd": {"path": self.dir, "capacity_bytes": 16 * MiB, "admission_policy": "all"},
            "promotion": {"admission_hits": 2},
        }).start()
        self.model: dict[str, bytes] = {}
        self.version = 0
        self.open: list[tuple[Reservation, int, bytes]] = []  # reservations not yet ended
        self.leases: list[tuple[SlotLease, int, bytes]] = []  # leases held, with what they read

    def teardown(self) -> None:
        self.store.close(flush=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _value(self, key: str, size: int) -> bytes:
        self.version += 1
        return payload(f"{key}/{self.version}", size).tobytes()

    @rule(key=MODEL_KEYS, size=MODEL_SIZES, owner=OWNERS)
    def reserve(self, key: str, size: int, owner: int) -> None:
        [r] = self.store.reserve([key], [size], owner=owner)
        if r.status is Status.EXISTS:
            assert key in self.model or any(o.key == key for o, _w, _v in self.open), key
            return
        if r.status is Status.NO_SPACE:
            return
        assert r.status is Status.OK and r.nbytes == size
        assert not any(o.key == key for o, _w, _v in self.open), f"{key} reserved twice"
        value = self._value(key, size)
        r.view[:] = value
        self.open.append((r, owner, value))

    @rule(data=st.data(), commit=st.booleans())
    def end_reservation(self, data: st.DataObject, commit: bool) -> None:
        if not self.open:
            return
        r, owner, value = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        assert not self.store.contains([r.key])[0] or r.key in self.model  # invisible until commit
        if commit:
            assert self.store.commit([r], owner=owner) == [Status.OK]
            self.model[r.key] = value
        else:
            self.store.abort([r], owner=owner)

    @rule(key=MODEL_KEYS, owner=OWNERS, stage_in=st.booleans())
    def lease(self, key: str, owner: int, stage_in: bool) -> None:
        [ls] = self.store.lease([key], owner=owner, stage_in=stage_in)
        if ls.status is Status.OK:
            got = bytes(ls.view)
            assert got == self.model.get(key), f"lease of {key} served bytes other than its value"
            self.leases.append((ls, owner, got))
        else:
            assert ls.status in (Status.NOT_FOUND, Status.NO_SPACE), ls.status

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.leases:
            return
        ls, owner, got = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        assert bytes(ls.view) == got
        assert self.store.release([ls], owner=owner) == [True]

    @rule(key=MODEL_KEYS, size=MODEL_SIZES)
    def put(self, key: str, size: int) -> None:
        value = self._value(key, size)
        st_ = self.store.put([key], [value])[0]
        if st_ is Status.OK:
            self.model[key] = value
        elif st_ is Status.EXISTS:
            assert key in self.model or any(o.key == key for o, _w, _v in self.open), key
        else:
            assert st_ is Status.NO_SPACE, st_

    @rule(key=MODEL_KEYS)
    def get(self, key: str) -> None:
        out = bytearray(MODEL_MAX)
        res = self.store.get_into([key], [out])[0]
        if res.status is Status.OK:
            assert bytes(out[:res.nbytes]) == self.model.get(key), f"get of {key} served bytes other than its value"
        else:
            assert res.status is Status.NOT_FOUND, res.status

    @rule(key=MODEL_KEYS)
    def remove(self, key: str) -> None:
        assert self.store.remove([key])[0] in (Status.OK, Status.NOT_FOUND)
        self.model.pop(key, None)
        # The remove took a reservation of the key: its commit answers OK and stores nothing.
        for r, o, _v in [x for x in self.open if x[0].key == key]:
            assert self.store.commit([r], owner=o) == [Status.OK]
            assert self.store.contains([key]) == [False]
        self.open = [x for x in self.open if x[0].key != key]

    @invariant()
    def leased_bytes_hold_and_reserved_keys_stay_hidden(self) -> None:
        for ls, _o, got in self.leases:
            assert bytes(ls.view) == got, f"the bytes of a lease of {ls.key} changed under it"
        for r, _o, _v in self.open:
            if r.key not in self.model:
                assert self.store.contains([r.key]) == [False], f"{r.key} visible before its commit"
        g = self.store.stats().slots
        assert (g.reservations, g.leases) == (len(self.open), len(self.leases))


TestSlotsVersusDict = SlotsVersusDict.TestCase
TestSlotsVersusDict.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
