"""The step's output (invalid block ids, worker meta) carries a load whose release said False, in
both orders vLLM 0.32 builds it: wait_for_save first (no speculative decoding), or the output first
and wait_for_save after the draft model (``defer_finalize``; a non-last pipeline rank never calls it)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_connector.keys import object_key
from tests.store_backend.node.server_harness import wait_until
from tests.vllm_plugin.conftest import tiny_model  # noqa: F401  (fixture)
from tests.vllm_plugin.test_worker_layers import _save, _slots_held, _UnstableReleases, _worker
from tests.vllm_plugin.test_worker_steps import LAYERS, make_worker  # noqa: F401  (fixture)
from vllm_plugin.metadata import ChunkLoad, ChunkSave, RequestPlan, TieredConnectorMetadata
from vllm_plugin.save_ledger import SaveLedger


@pytest.mark.parametrize("deferred", [False, True], ids=["finalize", "deferred-finalize"])
@pytest.mark.parametrize("copy", ["inline", "background"])
def test_a_release_saying_false_is_in_the_steps_own_output(make_worker: Any, copy: str, deferred: bool) -> None:
    w = _worker(make_worker, copy=copy)
    name = f"order-{copy}-{deferred}"
    _save(w, name, [0, 1], step=1)
    faulty = _UnstableReleases(w.store)
    w.client.store = faulty
    # The scheduler's ledger, as build_connector_meta drives it: the load of step 2 is registered and
    # the save over it (same request, next chunk) is held.
    ledger = SaveLedger(1)
    step = 2
    ledger.note_loads(step, [4, 5])
    [(save_id, hold)] = ledger.plan_saves("r", 1, 2, [4, 5, 6, 7], 2, [f"next-{name}"])
    assert hold
    meta = TieredConnectorMetadata(requests=[RequestPlan("r", loads=[ChunkLoad(name, [4, 5])],
                                                         saves=[ChunkSave(f"next-{name}", name, [6, 7],
                                                                          save_id=save_id, hold=True)])], step=step)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
        w.save_kv_layer(meta, layer)
    if not deferred:
        w.wait_for_save(meta)
    w.take_released()  # get_finished (get_transfer_results) comes first in vLLM's order
    invalid = w.take_load_errors()
    worker_meta = w.build_worker_meta()
    if deferred:
        w.wait_for_save(meta)  # finalize_kv_connector, after the draft model
    assert faulty.released == 1
    assert w.take_load_errors() == set(), "a load error surfaced after its step's output"
    assert invalid == {4, 5}, "the load whose release said False was reported OK in its step's output"
    ledger.on_output(worker_meta.steps, invalid, worker_meta.saves)
    commit, discard = ledger.take_decisions()
    assert save_id in discard and save_id not in commit
    w.start_load_kv(TieredConnectorMetadata(step=3, commit_saves=commit, discard_saves=discard))
    assert w.flush(10)
    wait_until(lambda: _slots_held(w) == 0, 10, "the held save's slot given back (its decision applied)")
    assert not w.store.contains([object_key(w.digest, f"next-{name}")])[0], \
        "a held save computed over a load whose release said False was committed"
