"""Tensor parallelism (TP=2, multiprocessing executor) on the CPU build: each rank with its own
embedded store and SSD directory, and both ranks attached to one node service.

Embedded: each TP rank is its own worker process with its own embedded store, so each must open its
own SSD directory (``<ssd.path>/dp0-tp<r>-pp0``): two processes on one directory crash at start or
read each other's records as CORRUPT. Engine A serves prompts and saves both ranks' shards; a fresh
TP=2 engine on the same directory must get the full external hit and, like A, exactly the tokens of
a TP=2 engine without the connector.

A failed load on one rank poisons every rank: rank 0's KV for a chunk computed over rank 1's failed
load is wrong too (each rank's attention output feeds both ranks' next layer). With rank 1's copy
of one chunk damaged, the chunks computed in the step of that load are discarded on both ranks,
the damaged chunk and those after it are recomputed and saved again, and a fresh engine gets the
full hit with the baseline tokens. Three engines prove both: engine A (the prompts, then the repair
test's short prompt), engine B (the long prompt over rank 1's damaged chunk: the repair) and
engine C, the fresh engine, which asks for both.

Node service: both workers attached to one service (``store: {"node": ...}``, ``python -m
store_backend.node serve``, a real subprocess) instead of an embedded store per rank. The service
holds both ranks' shards in one store: keys differ by shard, so no rank gets a directory or segment
of its own. The scheduler asks the service directly (one ``exists_all`` over both shards' keys), so
no worker opens a lookup socket. Engine A serves the prompts and saves both shards; engine B, a
fresh TP=2 engine, gets the full external hit from the service and the baseline's tokens.

One module, so that its TP=2 engines (each fills both cores) run one after the other on one xdist
worker and share one baseline. The embedded half's directories use the file backend (the repair
damages one of its record files in place); the bucket backend under engines is proven by
``test_e2e_eviction.py`` and by this module's node-service half.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_connector.config import NodeAttachConfig
from mooncake_connector.stores import acquire_node, release_store
from tests.node_service import node_service
from tests.ports import free_port
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.damage import damage_chunk
from tests.vllm_plugin.event_collector import EventCollector
from tests.vllm_plugin.test_e2e_repair import DAMAGED_CHUNK, P_LONG, P_SHORT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP_ENGINE = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# Two cores: one OpenMP thread per rank, each on its own core.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = [prompt(41, 300), prompt(42, 200)]
MAX_TOKENS = 12
# Round 0: the prompts; round 1: the repair test's long prompt.
ROUNDS = [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}, {"prompts": [P_LONG], "max_tokens": MAX_TOKENS}]


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_engine({"model_dir": str(tiny_model), "engine": TP_ENGINE, "connector": None, "rounds": ROUNDS},
                      tmp_path_factory.mktemp("tp-baseline"), "baseline", env=TP_ENV)


@pytest.fixture(scope="module")
def runs(tiny_model: Path, baseline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tp")
    ssd = work / "ssd"
    base = {"model_dir": str(tiny_model), "engine": TP_ENGINE, "rank_stats": True,
            "connector": {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}}}
    # Engine A also publishes KV events (the connector's kv_events, vLLM's publisher).
    port = free_port()
    with EventCollector(f"tcp://127.0.0.1:{port}") as events:
        a = run_engine({**base, "engine": {**TP_ENGINE, "kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}},
            "connector": {"extra": {**base["connector"]["extra"], "kv_events": True}},
            "rounds": [ROUNDS[0], {"prompts": [P_SHORT], "max_tokens": 4}]}, work, "engine-a", env=TP_ENV)
    dirs = sorted(p.name for p in ssd.iterdir())
    damage_chunk(ssd / "dp0-tp1-pp0", P_SHORT, DAMAGED_CHUNK)  # rank 1's copy only
    b = run_engine({**base, "rounds": [ROUNDS[1]]}, work, "repair-b", env=TP_ENV)
    c = run_engine({**base, "rounds": ROUNDS}, work, "fresh-c", env=TP_ENV)
    return {"baseline": baseline, "a": a, "b": b, "c": c, "dirs": dirs, "events": events.batches}


def _tokens(result: dict[str, Any], round_: int = 0) -> list[list[int]]:
    return [o["tokens"] for o in result["rounds"][round_]]


def test_each_rank_opens_its_own_ssd_directory(runs: dict[str, Any]) -> None:
    assert runs["dirs"] == ["dp0-tp0-pp0", "dp0-tp1-pp0"]


def test_tp2_engine_a_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    assert _tokens(runs["a"]) == _tokens(runs["baseline"])
    ranks = runs["a"]["stats"]["ranks"]
    assert len(ranks) == 2 and all(r["flushed"] for r in ranks)
    # Both ranks saved their shard of every whole prompt chunk.
    want = sum(len(p) // CHUNK_TOKENS for p in PROMPTS + [P_SHORT])
    assert [r["client"]["saved_objects"] >= want for r in ranks] == [True, True], ranks


def _between_resets(batches: list[Any]) -> list[list[Any]]:
    """The connector's events (CPU, STORAGE) between vLLM's own ``AllBlocksCleared`` (the engine
    runner resets the prefix cache before each round): after each reset the connector announces
    again what it had announced, so "once" holds between two resets."""
    out: list[list[Any]] = [[]]
    for e in (e for b in batches for e in b.events):
        if type(e).__name__ == "AllBlocksCleared":
            out.append([])
        elif getattr(e, "medium", None) in ("CPU", "STORAGE"):
            out[-1].append(e)
    return out


def _announced_once_per_span(batches: list[Any], medium: str) -> set[tuple[int, ...]]:
    """The token ids of every chunk announced in ``medium``, asserting none twice between two
    resets. (That the announcements come again after a reset is asserted where more steps follow
    the reset than here: test_e2e_weights.py; they come with the steps after it.)"""
    spans = [[tuple(e.token_ids) for e in span if type(e).__name__ == "BlockStored" and e.medium == medium]
             for span in _between_resets(batches)]
    for got in spans:
        assert len(got) == len(set(got)), (medium, len(got), len(set(got)))
    return {t for got in spans for t in got}


def test_tp2_kv_events_announce_each_chunk_once_for_both_ranks(runs: dict[str, Any]) -> None:
    """Both ranks save every chunk; the scheduler announces each one once (CPU), only when both
    ranks' reports are in, and in STORAGE at most once (when both ranks' stores have offloaded it),
    again only after vLLM's own prefix-cache reset; nothing is withdrawn (nothing was evicted or
    removed)."""
    want = {tuple(p[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS]) for p in PROMPTS
            for c in range((len(p) - 1) // CHUNK_TOKENS)}
    assert want <= _announced_once_per_span(runs["events"], "CPU")
    _announced_once_per_span(runs["events"], "STORAGE")
    assert not [e for span in _between_resets(runs["events"]) for e in span if type(e).__name__ == "BlockRemoved"]


def test_tp2_load_failed_on_one_rank_is_stored_by_no_rank(runs: dict[str, Any]) -> None:
    b = runs["b"]
    assert _tokens(b) == _tokens(runs["baseline"], 1)
    rank0, rank1 = b["stats"]["ranks"]
    assert (rank0["chunks_load_failed"], rank1["chunks_load_failed"]) == (0, 1)
    # Rank 0's own loads were fine, yet its chunks 4-5 (computed over rank 1's failed load) were
    # held in staging and discarded; rank 1 never staged them.
    assert rank0["saves_discarded"] == 2, rank0
    assert rank1["saves_skipped_failed_load"] == 2, rank1
    sched = b["stats"]["scheduler"]
    assert (sched["saves_held"], sched["saves_discarded"], sched["saves_committed"]) == (2, 2, 0), sched


def test_tp2_fresh_engine_gets_the_full_hit_of_both_and_baseline_tokens(runs: dict[str, Any]) -> None:
    c = runs["c"]
    # Round 0: engine A's prompts; round 1: the long prompt, from the store engine B repaired.
    assert [_tokens(c, 0), _tokens(c, 1)] == [_tokens(runs["baseline"], 0), _tokens(runs["baseline"], 1)]
    want_hits = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    full = (len(P_LONG) - 1) // CHUNK_TOKENS
    assert [o["num_cached_tokens"] for o in c["rounds"][0]] == want_hits
    assert c["rounds"][1][0]["num_cached_tokens"] == full * CHUNK_TOKENS
    for r in c["stats"]["ranks"]:
        assert (r["chunks_loaded"], r["chunks_load_failed"]) == (sum(want_hits) // CHUNK_TOKENS + full, 0), r


@pytest.fixture(scope="module")
def node_runs(tiny_model: Path, baseline: dict[str, Any],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("node-tp")
    lookup_dir = work / "lookup-sockets"
    lookup_dir.mkdir()
    store = {"dram": {"capacity_bytes": "64MiB"},
             "ssd": {"path": str(work / "ssd"), "capacity_bytes": "1GiB", "backend": "bucket"},
             "offload": {"policy": "eager"}}
    base = {"model_dir": str(tiny_model), "engine": TP_ENGINE, "rounds": ROUNDS[:1]}
    # The service publishes its KV events; engine A's connector follows them (kv_events) and
    # announces through vLLM's publisher. Its second round waits for the saves to reach the
    # service's SSD tier first, so that its steps carry the offload's changes.
    events_section = {"events": {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}}
    with node_service(work, store, sections=events_section) as svc:
        connector = {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": svc.attach(),
                               "lookup_socket_dir": str(lookup_dir)}}
        port = free_port()
        with EventCollector(f"tcp://127.0.0.1:{port}") as events:
            a = run_engine({**base, "connector": {"extra": {**connector["extra"], "kv_events": True}},
                            "engine": {**TP_ENGINE, "kv_events_config": {
                                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}},
                            "rounds": [ROUNDS[0], {"prompts": [PROMPTS[1]], "max_tokens": MAX_TOKENS, "flush": True}],
                            "rank_stats": True}, work, "engine-a", env=TP_ENV)
        b = run_engine({**base, "connector": connector, "rank_stats": True}, work, "engine-b", env=TP_ENV)
        client = acquire_node(NodeAttachConfig(socket=svc.socket), name="test")
        try:
            keys = client.keys()
        finally:
            release_store(client, flush=False)
        yield {"baseline": baseline, "a": a, "b": b, "keys": keys, "lookup_dir": lookup_dir,
               "ssd": work / "ssd", "status": svc.status(), "events": events.batches}


def test_node_both_ranks_shards_are_in_the_one_service(node_runs: dict[str, Any]) -> None:
    chunks = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    by_shard: dict[str, int] = {}
    for k in node_runs["keys"]:
        digest = k.partition("/")[0]
        by_shard[digest] = by_shard.get(digest, 0) + 1
    # Two shard prefixes (one per TP rank), each with every whole prompt chunk.
    assert sorted(by_shard.values()) == [chunks, chunks], by_shard
    # The service's own SSD directory, not one per rank.
    assert not [p for p in node_runs["ssd"].iterdir() if p.is_dir() and p.name.startswith("dp")]
    # No worker opened a lookup socket: the scheduler asked the service.
    assert list(node_runs["lookup_dir"].iterdir()) == []


def test_node_tp2_engine_a_tokens_equal_baseline(node_runs: dict[str, Any]) -> None:
    assert _tokens(node_runs["a"]) == _tokens(node_runs["baseline"])
    ranks = node_runs["a"]["stats"]["ranks"]
    assert len(ranks) == 2 and all(r["flushed"] for r in ranks)
    want = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    assert [r["client"]["saved_objects"] >= want for r in ranks] == [True, True], ranks


def test_node_tp2_fresh_engine_gets_full_hit_from_the_service(node_runs: dict[str, Any]) -> None:
    assert _tokens(node_runs["b"]) == _tokens(node_runs["baseline"])
    want_hits = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in node_runs["b"]["rounds"][0]] == want_hits
    for r in node_runs["b"]["stats"]["ranks"]:
        assert r["chunks_loaded"] == sum(want_hits) // CHUNK_TOKENS, r
        assert r["chunks_load_failed"] == 0
    sched = node_runs["b"]["stats"]["scheduler"]
    assert sched["lookup_failures"] == 0 and sched["hit_tokens"] == sum(want_hits), sched


def test_node_tp2_kv_events_follow_the_service_after_the_save(node_runs: dict[str, Any]) -> None:
    """With the node service, each chunk is announced once in CPU when both ranks' saves landed,
    and once in STORAGE when the service's own events say both shards reached its SSD tier (the
    workers follow the service's stream), again only after vLLM's own prefix-cache reset; nothing
    is withdrawn."""
    want = {tuple(p[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS]) for p in PROMPTS
            for c in range((len(p) - 1) // CHUNK_TOKENS)}
    for medium in ("CPU", "STORAGE"):
        assert want <= _announced_once_per_span(node_runs["events"], medium), medium
    events = [e for span in _between_resets(node_runs["events"]) for e in span]
    assert not [e for e in events if type(e).__name__ == "BlockRemoved"]
