"""The store's pure victim decisions, over every combination of facts, without a store."""

from __future__ import annotations

import itertools

import pytest

from store_backend.plans import (
    EvictPass,
    Verdict,
    VictimFacts,
    demotion_split,
    evict_pass_order,
    room_owed,
    victim_verdict,
)

MAX = 3


def evict_ok_as_it_was(f: VictimFacts, persisted_only: bool) -> tuple[bool, bool]:
    """The store's ``_reserve.evict_ok`` before the decision moved here, with its SSD lookups
    answered from the facts (``persisted`` honest, ``readmit`` for the declined parent check):
    (may evict, queued a write). Only evictable entries ever reached it."""
    if not persisted_only:
        return True, False
    if f.declined:
        if not f.readmit:
            return True, False
        return False, not f.offload_queued
    if not f.persisted:
        return False, 0 < f.offload_failures < MAX and not f.offload_queued
    return True, False


ALL_FACTS = [
    VictimFacts(key="k", size=1, evictable=ev, persisted=p, declined=d, readmit=r, offload_failures=n,
                offload_queued=q)
    for ev, p, d, r, n, q in itertools.product([True, False], [True, False], [True, False], [True, False],
                                               range(MAX + 2), [True, False])
]


def test_the_clean_pass_is_the_old_persisted_only_pass_for_every_fact_combination() -> None:
    """Without ``write_all`` (watermark mode, or workers not running), the first pass decides as
    the old persisted-only pass did; what it kept is split into WAIT (a write is coming) and KEEP."""
    for f in ALL_FACTS:
        v = victim_verdict(f, evict_pass=EvictPass.CLEAN, max_attempts=MAX)
        if not f.evictable:
            assert v is Verdict.KEEP, f
            continue
        evict, queued = evict_ok_as_it_was(f, True)
        assert (v is Verdict.EVICT) == evict, f
        # WRITE_BACK is "not now, and its write is owed": the store queues it unless it is queued.
        if queued:
            assert v is Verdict.WRITE_BACK, f
        if v is Verdict.WRITE_BACK:
            assert not evict and (queued or f.offload_queued), f
        if v is Verdict.KEEP:  # evictable and kept: only a dirty entry that used up its attempts
            assert not f.persisted and not f.declined and f.offload_failures >= MAX, f


@pytest.mark.parametrize("write_all", [False, True])
@pytest.mark.parametrize("evict_pass", [EvictPass.CLEAN, EvictPass.GIVEN_UP])
def test_no_pass_with_a_backing_tier_evicts_a_dirty_entry_whose_write_is_owed(evict_pass, write_all) -> None:
    """The old last pass evicted anything evictable, dirty or not (the issue's lost
    acknowledged writes); now a dirty entry goes only once its writes failed MAX times, and only
    in the GIVEN_UP pass."""
    for f in ALL_FACTS:
        v = victim_verdict(f, evict_pass=evict_pass, max_attempts=MAX, write_all=write_all)
        dirty = not f.persisted and not f.declined
        if v is Verdict.EVICT and dirty:
            assert evict_pass is EvictPass.GIVEN_UP and f.offload_failures >= MAX, f
        if v is Verdict.EVICT:
            assert f.evictable, f


def test_write_all_writes_back_every_dirty_entry_with_no_write_queued() -> None:
    """Offload workers running: a dirty entry with no write queued (put before start(), refused
    by a full queue, or in watermark mode not demoted yet) is queued by the eviction that meets
    it, not left waiting for a write nothing will do."""
    for f in ALL_FACTS:
        dirty_owed = f.evictable and not f.persisted and not f.declined and f.offload_failures < MAX
        v = victim_verdict(f, evict_pass=EvictPass.CLEAN, max_attempts=MAX, write_all=True)
        if dirty_owed:
            assert v is (Verdict.WAIT if f.offload_queued else Verdict.WRITE_BACK), f


def test_the_table_by_name() -> None:
    def facts(**kw) -> VictimFacts:  # noqa: ANN003
        base = dict(key="k", size=1, evictable=True, persisted=False, declined=False, readmit=False,
                    offload_failures=0, offload_queued=False)
        return VictimFacts(**{**base, **kw})

    def v(f: VictimFacts, evict_pass: EvictPass = EvictPass.CLEAN, write_all: bool = False) -> Verdict:
        return victim_verdict(f, evict_pass=evict_pass, max_attempts=MAX, write_all=write_all)

    assert v(facts(persisted=True)) is Verdict.EVICT
    assert v(facts()) is Verdict.WAIT  # dirty, no write owed yet: its write (or demotion) is coming
    assert v(facts(), write_all=True) is Verdict.WRITE_BACK  # workers run: nothing queued it, so eviction does
    assert v(facts(offload_queued=True), write_all=True) is Verdict.WAIT
    assert v(facts(offload_failures=1)) is Verdict.WRITE_BACK
    assert v(facts(offload_failures=1, offload_queued=True)) is Verdict.WAIT
    assert v(facts(offload_failures=MAX)) is Verdict.KEEP  # attempts used up: only the GIVEN_UP pass drops it
    assert v(facts(offload_failures=MAX), EvictPass.GIVEN_UP) is Verdict.EVICT
    assert v(facts(declined=True)) is Verdict.EVICT  # admission keeps it off SSD: a policy drop
    assert v(facts(declined=True, readmit=True)) is Verdict.WRITE_BACK
    # Changed: the old last pass (persisted_only=False) evicted this dirty entry; GIVEN_UP waits for it.
    assert v(facts(), EvictPass.GIVEN_UP) is Verdict.WAIT
    assert v(facts(offload_failures=2), EvictPass.GIVEN_UP) is Verdict.WRITE_BACK
    assert v(facts(), EvictPass.ANY) is Verdict.EVICT  # no backing tier: nothing to wait for
    assert v(facts(evictable=False, persisted=True), EvictPass.ANY) is Verdict.KEEP
    assert evict_pass_order(True) == (EvictPass.CLEAN, EvictPass.GIVEN_UP)
    assert evict_pass_order(False) == (EvictPass.ANY,)


def test_a_put_waits_for_room_only_when_the_offload_owes_some() -> None:
    assert room_owed(met_pending_write=False, writes_in_flight=True, offload_running=False)  # a flush writes
    assert room_owed(met_pending_write=True, writes_in_flight=False, offload_running=True)
    # A dirty entry waiting for a write no one will do (workers not started, or dead): refuse now.
    assert not room_owed(met_pending_write=True, writes_in_flight=False, offload_running=False)
    # Everything leased, pinned or given up: no write will make room.
    assert not room_owed(met_pending_write=False, writes_in_flight=False, offload_running=True)


def test_demotion_split_drops_clean_and_writes_the_rest() -> None:
    def f(key: str, **kw) -> VictimFacts:  # noqa: ANN003
        base = dict(size=1, evictable=True, persisted=False, declined=False, readmit=False,
                    offload_failures=0, offload_queued=False)
        return VictimFacts(key=key, **{**base, **kw})

    drop, write = demotion_split([f("p", persisted=True), f("d", declined=True), f("dr", declined=True, readmit=True),
                                  f("dirty"), f("failed", offload_failures=2)])
    assert drop == ["p", "d"] and write == ["dr", "dirty", "failed"]
    assert demotion_split([]) == ([], [])


# -- replica placement ---------------------------------------------------------------------------
from store_backend.plans import replica_targets  # noqa: E402
from store_backend.pool.directory import NodeInfo  # noqa: E402


def _node(node_id: str, free: int, alive: bool = True) -> NodeInfo:
    return NodeInfo(node_id, f"127.0.0.1:{1000 + len(node_id)}", capacity_bytes=free, used_bytes=0, alive=alive)


def test_replicas_go_to_the_peers_with_most_room_never_self_nor_dead() -> None:
    nodes = [_node("self", 10_000), _node("a", 300), _node("b", 500), _node("dead", 9_000, alive=False)]
    plan = replica_targets([("k1", 100), ("k2", 100), ("k3", 100)], nodes, "self", 2)
    # b has most room: k1 there (b 400 left), then k2 to b again (400 > 300), then k3: b 300 = a 300, tie -> a.
    assert plan == {"b": ["k1", "k2"], "a": ["k3"]}
    assert "self" not in plan and "dead" not in plan


def test_each_key_gets_distinct_peers_and_only_where_it_fits() -> None:
    nodes = [_node("a", 1000), _node("b", 1000), _node("c", 150)]
    plan = replica_targets([("big", 200), ("small", 100)], nodes, "self", 3)
    assert plan == {"a": ["big", "small"], "b": ["big", "small"]}
    # c could hold 'small' only, but two peers with more room are taken first.
    assert replica_targets([("big", 200)], [_node("c", 150)], "self", 2) == {}


def test_one_replica_or_no_peer_places_nothing_and_the_plan_is_deterministic() -> None:
    nodes = [_node("b", 500), _node("a", 500)]
    assert replica_targets([("k", 1)], nodes, "self", 1) == {}
    assert replica_targets([("k", 1)], [_node("self", 500)], "self", 2) == {}
    once = replica_targets([(f"k{i}", 10) for i in range(20)], nodes, "self", 2)
    assert once == replica_targets([(f"k{i}", 10) for i in range(20)], list(reversed(nodes)), "self", 2)
    assert sorted(once) == ["a", "b"] and len(once["a"]) == len(once["b"]) == 10
