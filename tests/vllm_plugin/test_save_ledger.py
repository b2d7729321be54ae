"""The scheduler's save ledger: no save computed over an unconfirmed load is committed, failures
are planned again, a save lands only when every rank stored it.

Outcomes reach the ledger as vLLM hands them to ``update_connector_output``: the union of the
workers' failed blocks (``KVOutputAggregator``) and the workers' merged reports
(``TieredWorkerMetadata.aggregate``, checked here with two ranks' objects).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm_plugin.metadata import SaveReport, TieredWorkerMetadata  # noqa: E402
from vllm_plugin.save_ledger import SaveLedger  # noqa: E402


def _merged(step: int, *reports: SaveReport) -> TieredWorkerMetadata:
    """Two ranks' reports for ``step``, merged as vLLM's executor merges them."""
    rank0 = TieredWorkerMetadata(steps=[step], saves=[r for r in reports if r.rank == 0])
    rank1 = TieredWorkerMetadata(steps=[step], saves=[r for r in reports if r.rank == 1])
    return rank0.aggregate(rank1)


def test_save_over_a_load_failed_on_another_rank_is_discarded() -> None:
    ledger = SaveLedger(num_ranks=2)
    step = ledger.begin_step()
    ledger.note_loads(step, [10, 11, 12, 13])  # chunks 0-1 loaded this step
    save_id, hold = ledger.plan_save("r", 2, [10, 11, 12, 13, 14, 15])  # chunk 2 computed over them
    assert hold
    # Rank 1's read of block 12 failed; rank 0's were fine. vLLM hands over the union.
    out = _merged(step)
    events = ledger.on_output(out.steps, {12}, out.saves)
    assert events.replan == [("r", 2)]
    assert ledger.take_decisions() == ([], [save_id])
    assert not ledger.unsettled("r")


def test_save_sharing_a_loaded_block_through_the_prefix_cache_is_held() -> None:
    ledger = SaveLedger(num_ranks=1)
    step = ledger.begin_step()
    ledger.note_loads(step, [10, 11])  # request A loads chunk 0 into blocks 10, 11
    # Request B hit blocks 10, 11 in vLLM's prefix cache and computes its chunk 1 in the same step.
    b_id, b_hold = ledger.plan_save("b", 1, [10, 11, 20, 21])
    other_id, other_hold = ledger.plan_save("c", 0, [30, 31])  # unrelated: committed at once
    assert b_hold and not other_hold
    events = ledger.on_output([step], {11}, [])
    assert events.replan == [("b", 1)]
    assert ledger.take_decisions() == ([], [b_id])
    assert ledger.unsettled("c")  # still in flight, never held


def test_next_step_planned_before_the_outcome_waits_for_it() -> None:
    """Async scheduling: step 2 is planned before step 1's output arrives."""
    ledger = SaveLedger(num_ranks=1)
    s1 = ledger.begin_step()
    ledger.note_loads(s1, [1, 2])
    s2 = ledger.begin_step()
    save_id, hold = ledger.plan_save("r", 1, [1, 2, 3, 4])  # planned in step 2 over step 1's loads
    assert hold
    assert ledger.on_output([s1], set(), []).replan == []  # step 1 came back clean
    assert ledger.take_decisions() == ([save_id], [])
    # Once committed, it lands with the rank's report.
    events = ledger.on_output([s2], set(), [SaveReport(save_id, 0, True)])
    assert events.landed == [("r", 1)]
    # Loads confirmed: a later save over the same blocks is not held.
    assert ledger.plan_save("r", 2, [1, 2, 3, 4, 5, 6])[1] is False


def test_a_save_waits_for_every_step_it_depends_on() -> None:
    ledger = SaveLedger(num_ranks=1)
    s1 = ledger.begin_step()
    ledger.note_loads(s1, [1])
    s2 = ledger.begin_step()
    ledger.note_loads(s2, [2])
    save_id, hold = ledger.plan_save("r", 1, [1, 2])
    assert hold
    ledger.on_output([s1], set(), [])
    assert ledger.take_decisions() == ([], [])  # step 2's load is still unknown
    events = ledger.on_output([s2], {2}, [])
    assert events.replan == [("r", 1)] and ledger.take_decisions() == ([], [save_id])


def test_a_save_lands_only_when_every_rank_stored_it() -> None:
    ledger = SaveLedger(num_ranks=2)
    ledger.begin_step()
    a, _ = ledger.plan_save("r", 0, [1, 2])
    b, _ = ledger.plan_save("r", 1, [1, 2, 3, 4])
    out = _merged(1, SaveReport(a, 0, True), SaveReport(b, 0, True), SaveReport(b, 1, False))
    events = ledger.on_output(out.steps, set(), out.saves)
    assert events.landed == [] and events.replan == [("r", 1)]  # b failed on rank 1: plan again
    events = ledger.on_output([2], set(), [SaveReport(a, 1, True), SaveReport(b, 0, True)])
    assert events.landed == [("r", 0)] and events.replan == []  # a late report of b changes nothing
    assert not ledger.unsettled("r")


def test_planning_several_chunks_holds_exactly_those_computed_over_a_pending_load() -> None:
    ledger = SaveLedger(num_ranks=1)
    step = ledger.begin_step()
    ledger.note_loads(step, [14, 15])  # the request's chunk 2 (blocks 4-5) is loaded this step
    blocks = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    planned = ledger.plan_saves("r", 0, 5, blocks, blocks_per_chunk=2)
    assert [hold for _id, hold in planned] == [False, False, True, True, True]
    events = ledger.on_output([step], {15}, [])
    assert events.replan == [("r", 2), ("r", 3), ("r", 4)]
    assert ledger.take_decisions() == ([], [i for i, _ in planned[2:]])


def test_a_failed_save_names_its_chunk_for_other_requests_counting_on_it() -> None:
    ledger = SaveLedger(num_ranks=2)
    ledger.begin_step()
    (ok_id, _), (bad_id, _) = ledger.plan_saves("a", 0, 2, [1, 2, 3, 4], 2, ["h0", "h1"])
    assert ledger.unsettled_chunks(["h1"]) and not ledger.unsettled_chunks(["other"])
    out = _merged(1, SaveReport(ok_id, 0, True), SaveReport(ok_id, 1, True), SaveReport(bad_id, 1, False))
    events = ledger.on_output([], set(), out.saves)
    assert events.landed == [("a", 0)] and events.replan == [("a", 1)]
    assert events.failed == [(1, "h1")]  # by hash: any request whose chain holds it plans it again
    assert not ledger.unsettled_chunks(["h0", "h1"])
