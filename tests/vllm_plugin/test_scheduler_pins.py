"""Every chunk the scheduler reports to vLLM as an external hit is leased (pinned) in the store when
it is reported, so puts that fill a small DRAM tier between that answer and the worker's load
cannot evict it, and a chunk evicted before the answer is not reported. Driven with vLLM's own
``Request`` and ``KVCacheBlocks`` against a real DRAM-only store behind the lookup socket, the way
vLLM's scheduler drives the connector: a waiting request is asked again on later steps (its blocks
could not be allocated yet) while other requests' saves land.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.lookup_service import LookupServer  # noqa: E402
from store_backend.types import Status  # noqa: E402
from store_backend.store import TieredStore  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt  # noqa: E402
from tests.vllm_plugin.test_scheduler_saves import (  # noqa: E402, F401
    _ask, _first_step, _gated_lookup, _in_flight_prefix, _request, make_scheduler)
from vllm_plugin.metadata import TieredWorkerMetadata  # noqa: E402

pytestmark = pytest.mark.vllm

OBJ = 256 * 1024
# Four objects' room: the three chunks of one request and one other object.
DRAM = {"dram": {"capacity_bytes": 4 * OBJ, "eviction_policy": "lru"}}


def _fill(client: KVClient, n: int, tag: str) -> None:
    """Other requests' saves: ``n`` objects through the DRAM tier (refused ones are fine)."""
    for i in range(n):
        client.save([f"{tag}-{i}"], [np.full(OBJ, i, np.uint8)]).result(10)


def _loads_leasable(sched: Any, client: KVClient, req: Any, hit: int) -> list[Status]:
    """vLLM allocates ``hit`` external tokens; more saves land; then the worker leases the plan."""
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(x) for x in range(300, 310)],)), hit)
    keys = sched.object_keys([ld.chunk_hash for ld in sched.tracked(req.request_id).plan_loads])[0]
    _fill(client, 6, "after-alloc")
    leases = client.lease(keys, ttl_s=10, unpin_after=True)
    client.release_quietly([ls for ls in leases if ls.status is Status.OK])
    return [ls.status for ls in leases]


def _stored(sched: Any, client: KVClient, tokens: list[int]) -> list[str]:
    meta = _first_step(sched, _request("A", tokens), list(range(200, 210)))
    keys = sched.object_keys([s.chunk_hash for plan in meta.requests for s in plan.saves])[0]
    assert len(keys) == 3
    for k in keys:
        assert client.save([k], [np.zeros(OBJ, np.uint8)]).result(10)[0].ok
    return keys


@contextlib.contextmanager
def _served(sched: Any) -> Iterator[tuple[TieredStore, KVClient]]:
    """A real DRAM-only store behind the scheduler's lookup socket, closed after."""
    with TieredStore(DRAM) as store:
        client = KVClient(store).start()
        server = LookupServer(client, sched.lookups[0].path).start()
        try:
            yield store, client
        finally:
            server.close()
            client.close()


def test_a_hit_reported_to_a_waiting_request_stays_loadable(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")
    tokens = prompt(5, 3 * CHUNK_TOKENS + 1)
    with _served(sched) as (store, client):
        keys = _stored(sched, client, tokens)
        b = _request("B", tokens)
        assert _ask(sched, b, 0) == 3 * CHUNK_TOKENS  # vLLM cannot allocate B's blocks yet
        _fill(client, 6, "others")  # meanwhile other requests' saves fill the DRAM tier
        hit = _ask(sched, b, 0)  # asked again on a later step
        assert hit > 0, "the hit reported first was pinned: nothing may evict it"
        assert all(store.contains(keys[:hit // CHUNK_TOKENS]))
        statuses = _loads_leasable(sched, client, b, hit)
        assert statuses and all(s is Status.OK for s in statuses), statuses


def test_a_chunk_evicted_after_the_lookup_is_not_reported(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")
    tokens = prompt(6, 3 * CHUNK_TOKENS + 1)
    with _served(sched) as (store, client):
        keys = _stored(sched, client, tokens)
        b = _request("B", tokens)
        sched.on_new_request(b)  # the lookup starts on arrival and finds all three chunks
        t = sched.tracked("B")
        assert t.lookup is not None and t.lookup.result(10) == 3
        _fill(client, 6, "others")  # evicts them before vLLM first asks
        assert not any(store.contains(keys))
        hit = _ask(sched, b, 0)
        assert hit == 0, f"reported {hit} tokens of chunks no longer stored"


def test_a_partly_evicted_hit_is_cut_to_the_chunks_still_stored(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")
    tokens = prompt(7, 3 * CHUNK_TOKENS + 1)
    with _served(sched) as (store, client):
        keys = _stored(sched, client, tokens)
        b = _request("B", tokens)
        sched.on_new_request(b)
        assert sched.tracked("B").lookup.result(10) == 3
        assert store.remove([keys[2]]) == [Status.OK]  # the last chunk goes; the first two stay
        hit = _ask(sched, b, 0)
        assert hit == 2 * CHUNK_TOKENS
        statuses = _loads_leasable(sched, client, b, hit)
        assert statuses == [Status.OK, Status.OK]


def test_chunks_whose_saves_are_in_flight_still_count(make_scheduler: Any) -> None:
    """A save in flight cannot be pinned (nothing is stored yet) but still counts as a hit, as the
    lookup counts it: the worker's load waits for it to land."""
    sched = make_scheduler("kv_both")
    with _gated_lookup(sched) as client:
        tokens = prompt(8, 3 * CHUNK_TOKENS + 1)
        _in_flight_prefix(sched, client, tokens[:3 * CHUNK_TOKENS], list(range(10, 16)))
        b = _request("B", tokens)
        assert _ask(sched, b, 0) == 3 * CHUNK_TOKENS
        sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(x) for x in range(30, 37)],)),
                                       3 * CHUNK_TOKENS)
        assert len(sched.tracked("B").plan_loads) == 3


def test_the_staging_cap_applies_only_while_loads_go_through_staging(make_scheduler: Any) -> None:
    """A pool of one chunk. On the CPU the loads come from the store's slots (both stores have
    them), so a three-chunk hit is reported whole from the start; once the workers report loads
    through staging it is cut to the pool, and whole again once they report slots."""
    sched = make_scheduler("kv_both")
    sched.staging_chunks = sched.load_budget = 1
    tokens = prompt(11, 3 * CHUNK_TOKENS + 1)

    def report(staged: bool) -> None:
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
            staged_loads=staged)))

    try:
        with _served(sched) as (_store, client):
            _stored(sched, client, tokens)
            assert sched.stats()["staged_loads"] is False
            assert _ask(sched, _request("B", tokens), 0) == 3 * CHUNK_TOKENS
            report(staged=True)
            assert _ask(sched, _request("C", tokens), 0) == CHUNK_TOKENS
            report(staged=False)
            assert _ask(sched, _request("D", tokens), 0) == 3 * CHUNK_TOKENS
        assert sched.stats()["hits_capped_staging"] == 1
    finally:
        sched.close()
