"""Tensor parallelism (TP=2, multiprocessing executor, CPU build) with both workers attached to one
node service (``store: {"node": ...}``) instead of an embedded store per rank.

The service (``python -m store_backend.node serve``, a real subprocess) holds both ranks' shards in
one store: keys differ by shard, so no rank gets a directory or segment of its own. The scheduler
asks the service directly (one ``exists_all`` over both shards' keys), so no worker opens a lookup
socket. Engine A serves the prompts and saves both shards; engine B, a fresh TP=2 engine, gets the
full external hit from the service and, like A, exactly the tokens of a TP=2 engine without the
connector.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_connector.config import NodeAttachConfig
from mooncake_connector.stores import acquire_node, release_store
from tests.node_service import node_service
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP_ENGINE = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# Two cores: one OpenMP thread per rank, each on its own core.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = [prompt(141, 300), prompt(142, 200)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("node-tp")
    lookup_dir = work / "lookup-sockets"
    lookup_dir.mkdir()
    store = {"dram": {"capacity_bytes": "64MiB"},
             "ssd": {"path": str(work / "ssd"), "capacity_bytes": "1GiB", "backend": "bucket"},
             "offload": {"policy": "eager"}}
    rounds = [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]
    base = {"model_dir": str(tiny_model), "engine": TP_ENGINE, "rounds": rounds}
    baseline = run_engine({**base, "connector": None}, work, "baseline", env=TP_ENV)
    with node_service(work, store) as svc:
        connector = {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": svc.attach(),
                               "lookup_socket_dir": str(lookup_dir)}}
        a = run_engine({**base, "connector": connector, "rank_stats": True}, work, "engine-a", env=TP_ENV)
        b = run_engine({**base, "connector": connector, "rank_stats": True}, work, "engine-b", env=TP_ENV)
        client = acquire_node(NodeAttachConfig(socket=svc.socket), name="test")
        try:
            keys = client.keys()
        finally:
            release_store(client, flush=False)
        yield {"baseline": baseline, "a": a, "b": b, "keys": keys, "lookup_dir": lookup_dir,
               "ssd": work / "ssd", "status": svc.status()}


def _tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in result["rounds"][0]]


def test_both_ranks_shards_are_in_the_one_service(runs: dict[str, Any]) -> None:
    chunks = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    by_shard: dict[str, int] = {}
    for k in runs["keys"]:
        digest = k.partition("/")[0]
        by_shard[digest] = by_shard.get(digest, 0) + 1
    # Two shard prefixes (one per TP rank), each with every whole prompt chunk.
    assert sorted(by_shard.values()) == [chunks, chunks], by_shard
    # The service's own SSD directory, not one per rank.
    assert not [p for p in runs["ssd"].iterdir() if p.is_dir() and p.name.startswith("dp")]
    # No worker opened a lookup socket: the scheduler asked the service.
    assert list(runs["lookup_dir"].iterdir()) == []


def test_tp2_engine_a_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    assert _tokens(runs["a"]) == _tokens(runs["baseline"])
    ranks = runs["a"]["stats"]["ranks"]
    assert len(ranks) == 2 and all(r["flushed"] for r in ranks)
    want = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    assert [r["client"]["saved_objects"] >= want for r in ranks] == [True, True], ranks


def test_tp2_fresh_engine_gets_full_hit_from_the_service(runs: dict[str, Any]) -> None:
    assert _tokens(runs["b"]) == _tokens(runs["baseline"])
    want_hits = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in runs["b"]["rounds"][0]] == want_hits
    for r in runs["b"]["stats"]["ranks"]:
        assert r["chunks_loaded"] == sum(want_hits) // CHUNK_TOKENS, r
        assert r["chunks_load_failed"] == 0
    sched = runs["b"]["stats"]["scheduler"]
    assert sched["lookup_failures"] == 0 and sched["hit_tokens"] == sum(want_hits), sched
