"""The store's pure victim decisions, over every combination of facts, without a store."""

from __future__ import annotations

import itertools

import pytest

from store_backend.plans import Verdict, VictimFacts, demotion_split, evict_pass_order, victim_verdict

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


@pytest.mark.parametrize("persisted_only", [True, False])
def test_verdict_matches_the_old_eviction_rule_for_every_fact_combination(persisted_only) -> None:
    for f in ALL_FACTS:
        v = victim_verdict(f, persisted_only=persisted_only, max_attempts=MAX)
        if not f.evictable:
            assert v is Verdict.KEEP, f
            continue
        evict, queued = evict_ok_as_it_was(f, persisted_only)
        assert (v is Verdict.EVICT) == evict, f
        # WRITE_BACK is "not now, and its write is owed": the store queues it unless it is queued.
        if queued:
            assert v is Verdict.WRITE_BACK, f
        if v is Verdict.WRITE_BACK:
            assert not evict and (queued or f.offload_queued), f


def test_the_table_by_name() -> None:
    def facts(**kw) -> VictimFacts:  # noqa: ANN003
        base = dict(key="k", size=1, evictable=True, persisted=False, declined=False, readmit=False,
                    offload_failures=0, offload_queued=False)
        return VictimFacts(**{**base, **kw})

    def v(f: VictimFacts, persisted_only: bool = True) -> Verdict:
        return victim_verdict(f, persisted_only=persisted_only, max_attempts=MAX)

    assert v(facts(persisted=True)) is Verdict.EVICT
    assert v(facts()) is Verdict.KEEP  # dirty, no write owed yet: its write is coming
    assert v(facts(offload_failures=1)) is Verdict.WRITE_BACK
    assert v(facts(offload_failures=1, offload_queued=True)) is Verdict.KEEP
    assert v(facts(offload_failures=MAX)) is Verdict.KEEP  # attempts used up: only the last pass drops it
    assert v(facts(declined=True)) is Verdict.EVICT
    assert v(facts(declined=True, readmit=True)) is Verdict.WRITE_BACK
    assert v(facts(), persisted_only=False) is Verdict.EVICT
    assert v(facts(evictable=False, persisted=True), persisted_only=False) is Verdict.KEEP
    assert evict_pass_order(True) == (True, False) and evict_pass_order(False) == (False,)


def test_demotion_split_drops_clean_and_writes_the_rest() -> None:
    def f(key: str, **kw) -> VictimFacts:  # noqa: ANN003
        base = dict(size=1, evictable=True, persisted=False, declined=False, readmit=False,
                    offload_failures=0, offload_queued=False)
        return VictimFacts(key=key, **{**base, **kw})

    drop, write = demotion_split([f("p", persisted=True), f("d", declined=True), f("dr", declined=True, readmit=True),
                                  f("dirty"), f("failed", offload_failures=2)])
    assert drop == ["p", "d"] and write == ["dr", "dirty", "failed"]
    assert demotion_split([]) == ([], [])
