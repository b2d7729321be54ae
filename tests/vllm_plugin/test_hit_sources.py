"""The scheduler files each planned load's tokens under the tier that held the chunk (vLLM's
``vllm:prompt_tokens_cached_by_source``): DRAM as host, SSD as disk. Driven with vLLM's own
``Request`` and ``KVCacheBlocks`` against a real store behind the lookup socket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.lookup_service import LookupServer  # noqa: E402
from store_backend.store import TieredStore  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt  # noqa: E402
from tests.vllm_plugin.test_scheduler_saves import _ask, _first_step, _request, make_scheduler  # noqa: E402, F401

pytestmark = pytest.mark.vllm


@contextlib.contextmanager
def served_on_two_tiers(sched: Any, keys: list[str], tmp_path: Path) -> Iterator[TieredStore]:
    """A real store holding ``keys`` (four chunks), the first two on SSD only and the last two in
    DRAM, served to ``sched`` on rank 0's lookup socket."""
    cfg = {"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "file"},
           "offload": {"policy": "eager"}, "promotion": {"enabled": False}}
    with TieredStore(cfg) as store:
        client = KVClient(store).start()
        # Chunks 0-3, then two other objects: 1.5 MiB through 1 MiB of DRAM, chunks 0 and 1 go to SSD.
        for k in [*keys, "other-1", "other-2"]:
            assert client.save([k], [np.zeros(OBJ, np.uint8)]).result(10)[0].ok
            assert store.flush(timeout_s=30)
        assert store.tier_of(keys) == ["ssd", "ssd", "dram", "dram"]
        server = LookupServer(client, sched.lookups[0].path).start()
        try:
            yield store
        finally:
            server.close()
            client.close()

MiB = 1 << 20
OBJ = 256 * 1024


def test_hits_are_filed_under_the_tier_that_held_each_chunk(make_scheduler: Any, tmp_path: Path) -> None:
    sched = make_scheduler("kv_both")
    tokens = prompt(2, 4 * CHUNK_TOKENS + 1)
    blocks = list(range(200, 210))
    meta = _first_step(sched, _request("A", tokens), blocks)
    keys = sched.object_keys([s.chunk_hash for plan in meta.requests for s in plan.saves])[0]
    assert len(keys) == 4
    with served_on_two_tiers(sched, keys, tmp_path):
        b = _request("B", tokens)
        hit = _ask(sched, b, 0)
        assert hit == 4 * CHUNK_TOKENS
        sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(x) for x in range(300, 310)],)), hit)
        assert sched.hit_sources(b, hit) == {CacheHitSource.DISK: 2 * CHUNK_TOKENS,
                                             CacheHitSource.HOST: 2 * CHUNK_TOKENS}
        # A count that does not match the plan (vLLM asking about something else) is not guessed at.
        assert sched.hit_sources(b, hit - 1) == {CacheHitSource.EXTERNAL_UNSPECIFIED: hit - 1}
        assert sched.hit_sources(b, 0) == {}


def test_lookups_no_worker_answered_are_reported_as_peer_gone(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")  # no lookup server on its socket: the worker is gone
    req = _request("lonely", prompt(3, 3 * CHUNK_TOKENS + 1))
    assert _ask(sched, req, 0) == 0  # a lookup nobody answers is a miss
    stats = sched.take_stats()
    assert stats is not None
    assert stats.data["deltas"]["mooncake_kv_connector_failures"]["peer_gone"] >= 1
    assert "mooncake_kv_connector_hit_tokens" not in stats.data["deltas"]
