"""The connector's KV events on the scheduler side, with vLLM's own objects (no engine): a chunk is
announced once every rank stored it, self-describing (vLLM's block hashes of its blocks, as vLLM
converts them for its events, the parent, the tokens, LoRA), once; a failed save announces
nothing; a failed load and a cache reset announce the removal of what was announced; nothing at
all without ``kv_events`` or without vLLM's --kv-events-config."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher, init_none_hash,  # noqa: E402
                                         maybe_convert_block_hash)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from mooncake_connector.config import load_connector_config  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt  # noqa: E402
from tests.vllm_plugin.test_hit_sources import served_on_two_tiers  # noqa: E402
from tests.vllm_plugin.test_scheduler_saves import GEOMETRY, _ask, _first_step, _land_all, _saves  # noqa: E402
from vllm_plugin.metadata import ResidencyReport, SaveReport, TieredWorkerMetadata  # noqa: E402
from vllm_plugin.scheduler import SchedulerSide  # noqa: E402

BLOCK = GEOMETRY.block_size
HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)


@pytest.fixture(scope="module")
def make_scheduler(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    sockets = tmp_path_factory.mktemp("sockets")

    def make(*, kv_events: bool = True, vllm_events: bool = True, shards: int = 1,
             endpoint: str | None = None) -> SchedulerSide:
        """``endpoint``: vLLM's publisher is "zmq" on it (else "null")."""
        extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(sockets), "kv_events": kv_events}
        ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role="kv_both",
                               kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra)
        publisher = {"publisher": "zmq", "endpoint": endpoint} if endpoint else {"publisher": "null"}
        events = KVEventsConfig(enable_kv_cache_events=True, **publisher) if vllm_events else None
        config = EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, block_size=BLOCK, dtype="float32",
                            max_model_len=4096, enforce_eager=True, kv_transfer_config=ktc,
                            kv_events_config=events, tensor_parallel_size=shards).create_engine_config()
        return SchedulerSide(config, load_connector_config(extra), msgspec.structs.replace(GEOMETRY, shard_count=shards))

    return make


def _request(req_id: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, lora_request=lora,
                   block_hasher=get_request_block_hasher(BLOCK, HASH_FN))


def _stored(events) -> list[BlockStored]:  # noqa: ANN001
    return [e for e in events if isinstance(e, BlockStored)]


def test_a_landed_chunk_is_announced_once_and_self_describing(make_scheduler: Any) -> None:
    sched = make_scheduler()
    lora = LoRARequest("ad", 3, "/nonexistent")
    tokens = prompt(1, 2 * CHUNK_TOKENS + 5)
    req = _request("r", tokens, lora)
    meta = _first_step(sched, req, list(range(10, 20)))
    assert [b for b, _i, _h in _saves(meta)] == [10, 12]
    assert sched.take_events() == []  # planned, not stored yet
    _land_all(sched, meta)
    got = _stored(sched.take_events())
    bpc = CHUNK_TOKENS // BLOCK
    assert len(got) == 2
    for c, e in enumerate(got):
        assert e.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[c * bpc:(c + 1) * bpc]]
        assert e.parent_block_hash == (maybe_convert_block_hash(req.block_hashes[c * bpc - 1]) if c else None)
        assert e.token_ids == tokens[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS]
        assert (e.block_size, e.medium, e.lora_name, e.lora_id, e.group_idx, e.locality) == (
            BLOCK, "CPU", "ad", 3, 0, "LOCAL")
        assert e.extra_keys == [("ad",)] * bpc  # vLLM's untagged per-block keys: the LoRA name
    # The same chunks saved again (another request of the same prompt) are not announced again.
    meta2 = _first_step(sched, _request("r2", tokens, lora), list(range(30, 40)))
    _land_all(sched, meta2)
    assert sched.take_events() == []


def test_tp2_announces_only_what_both_ranks_stored_and_a_failed_save_nothing(make_scheduler: Any) -> None:
    sched = make_scheduler(shards=2)
    req = _request("t", prompt(2, 2 * CHUNK_TOKENS + 1))
    meta = _first_step(sched, req, list(range(10, 20)))
    (_, s0, _), (_, s1, _) = _saves(meta)

    def report(*saves: SaveReport) -> None:
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
            steps=[meta.step], saves=list(saves))))

    report(SaveReport(s0, 0, True), SaveReport(s1, 0, True))
    assert sched.take_events() == []  # rank 1 has not stored them yet
    report(SaveReport(s0, 1, True), SaveReport(s1, 1, False))  # chunk 1 failed on rank 1
    got = _stored(sched.take_events())
    assert len(got) == 1 and got[0].token_ids == req.all_token_ids[:CHUNK_TOKENS]


def test_a_failed_load_and_a_reset_announce_removals(make_scheduler: Any) -> None:
    sched = make_scheduler()
    req = _request("x", prompt(3, 3 * CHUNK_TOKENS + 1))
    blocks = list(range(50, 60))
    meta = _first_step(sched, req, blocks)
    _land_all(sched, meta)
    announced = _stored(sched.take_events())
    assert len(announced) == 3
    # A later load into chunk 1's blocks failed: that chunk is announced gone.
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={blocks[2]}))
    removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.medium) for e in removed] == [(announced[1].block_hashes, "CPU")]
    assert sched.reset_cache() is True
    removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(map(tuple, (e.block_hashes for e in removed))) == sorted(
        tuple(announced[i].block_hashes) for i in (0, 2))
    assert all(type(e).__name__ != "AllBlocksCleared" for e in removed)


def test_after_vllms_own_reset_every_announced_chunk_is_announced_again(make_scheduler: Any, tmp_path: Path) -> None:
    """vLLM's own ``AllBlocksCleared`` (a prefix-cache reset the connector is not told of),
    published by vLLM's own ZMQ publisher on the endpoint the engine's config names: the connector
    sees it on that stream, and its next ``take_events`` (a later batch than the reset's) announces
    every chunk it announces now again, each once, in its medium; a chunk withdrawn before is not.
    Without a reset, nothing."""
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    sched = make_scheduler(endpoint=endpoint)
    try:
        blocks = list(range(60, 70))
        _land_all(sched, _first_step(sched, _request("ra", prompt(9, 3 * CHUNK_TOKENS + 1)), blocks))
        announced = _stored(sched.take_events())
        assert len(announced) == 3
        sched.update_connector_output(KVConnectorOutput(invalid_block_ids={blocks[2]}))  # chunk 1 withdrawn
        assert [type(e) for e in sched.take_events()] == [BlockRemoved]
        assert sched.take_events() == [] and sched.stats()["kv_events_reannounced"] == 0
        # The subscription is live some time after the connect (ZMQ drops what is sent before):
        # a reset is published again until the connector has seen one.
        deadline = time.monotonic() + 30
        got: list = []
        while not got:
            assert time.monotonic() < deadline, "the connector never saw vLLM's AllBlocksCleared"
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            until = time.monotonic() + 0.5
            while not got and time.monotonic() < until:
                got = sched.take_events()
        assert got == [announced[0], announced[2]]
        assert sched.stats()["kv_events_reannounced"] >= 1
    finally:
        sched.close()
        publisher.shutdown()


def _landed_chunks(events: Any, tokens: list[int], n: int) -> Request:
    req = _request(f"r{tokens[0]}", tokens)
    for c in range(n):
        events.planned(req, c, f"h{tokens[0]}-{c}", 1000 * tokens[0] + c)
        events.landed(1000 * tokens[0] + c)
    return req


def test_a_reannouncement_skips_what_went_out_with_or_after_the_reset_per_medium() -> None:
    """The reset's batch holds what the take before it gave, after the reset: a chunk that gained
    STORAGE in that take is announced again in CPU only (announced before the reset), and a medium
    withdrawn since is not announced again."""
    from vllm_plugin.kv_events import ConnectorEvents
    from vllm_plugin.worker_residency import SSD_IN

    events = ConnectorEvents(BLOCK, CHUNK_TOKENS // BLOCK)
    _landed_chunks(events, prompt(21, 2 * CHUNK_TOKENS + 1), 2)
    assert [e.medium for e in events.take()] == ["CPU", "CPU"]
    events.changed(0, "h%d-0" % prompt(21, 1)[0], SSD_IN)  # chunk 0 reaches SSD in the reset's step
    assert [e.medium for e in events.take()] == ["STORAGE"]
    cleared_at = time.time()  # vLLM stamps the batch right after the connector's take
    events.reannounce(cleared_at)
    got = events.take()
    assert [(e.medium, e.token_ids[0]) for e in got] == [("CPU", prompt(21, 1)[0]), ("CPU", prompt(21, 65)[64])]
    assert events.take() == []  # once


def test_a_reannouncement_is_spread_over_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_plugin import kv_events

    monkeypatch.setattr(kv_events, "REANNOUNCE_PER_TAKE", 2)
    events = kv_events.ConnectorEvents(BLOCK, CHUNK_TOKENS // BLOCK)
    _landed_chunks(events, prompt(22, 3 * CHUNK_TOKENS + 1), 3)
    assert len(events.take()) == 3
    assert events.take() == []  # a step later, vLLM's reset goes out
    events.reannounce(time.time())
    events.gone(["h%d-2" % prompt(22, 1)[0]])  # withdrawn before its turn: not announced again
    assert [type(e).__name__ for e in events.take()] == ["BlockRemoved", "BlockStored", "BlockStored"]
    assert events.take() == [] and events.reannounces == 1


@pytest.mark.parametrize("endpoint, rank, want", [
    ("tcp://*:5557", 0, "tcp://127.0.0.1:5557"), ("tcp://*:5557", 2, "tcp://127.0.0.1:5559"),
    ("tcp://[::]:5557", 0, "tcp://[::1]:5557"), ("tcp://[2001:db8::5]:5557", 1, "tcp://[2001:db8::5]:5558"),
    ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ("inproc://kv", 1, "inproc://kv_dp1"),
    ("tcp://*:0", 0, None),  # a port chosen at bind time
    ("tcp://10.0.0.5:5557", 0, None),  # vLLM connects out to it (a broker)
    ("ipc:///tmp/kv", 1, None)])  # vLLM's own publisher refuses it
def test_the_watched_endpoint_is_where_vllm_binds(endpoint: str, rank: int, want: str | None) -> None:
    from vllm_plugin.cleared_watch import own_endpoint

    assert own_endpoint(endpoint, rank) == want


@pytest.mark.parametrize("kv_events, vllm_events", [(False, True), (True, False)])
def test_nothing_without_both_switches(make_scheduler: Any, kv_events: bool, vllm_events: bool) -> None:
    sched = make_scheduler(kv_events=kv_events, vllm_events=vllm_events)
    meta = _first_step(sched, _request("n", prompt(4, CHUNK_TOKENS + 1)), list(range(10, 20)))
    _land_all(sched, meta)
    assert sched.events is None and sched.take_events() == []


def _residency(sched: SchedulerSide, *reports: ResidencyReport, gaps: tuple[int, ...] = ()) -> list[tuple[str, str]]:
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        residency=list(reports), residency_gaps=list(gaps))))
    return [(type(e).__name__, e.medium) for e in sched.take_events()]


def test_tier_changes_announce_a_medium_once_every_rank_holds_it(make_scheduler: Any) -> None:
    sched = make_scheduler(shards=2)
    req = _request("m", prompt(5, CHUNK_TOKENS + 1))
    meta = _first_step(sched, req, list(range(10, 20)))
    [(_, sid, _)] = _saves(meta)
    h = sched.chunk_hashes(req, 1)[0]
    # Rank 0 offloads to SSD before rank 1 has even confirmed the save.
    assert _residency(sched, ResidencyReport(0, h, "ssd+")) == []
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=[meta.step], saves=[SaveReport(sid, 0, True), SaveReport(sid, 1, True)])))
    assert [(type(e).__name__, e.medium) for e in sched.take_events()] == [("BlockStored", "CPU")]
    assert _residency(sched, ResidencyReport(1, h, "ssd+")) == [("BlockStored", "STORAGE")]
    assert _residency(sched, ResidencyReport(1, h, "dram-")) == [("BlockRemoved", "CPU")]  # one rank is enough
    assert _residency(sched, ResidencyReport(0, h, "dram-"), ResidencyReport(1, h, "dram+")) == []
    assert _residency(sched, ResidencyReport(0, h, "dram+")) == [("BlockStored", "CPU")]
    assert _residency(sched, ResidencyReport(0, h, "gone")) == [("BlockRemoved", "CPU"), ("BlockRemoved", "STORAGE")]
    assert _residency(sched, ResidencyReport(1, h, "ssd-")) == []  # no longer announced


def test_a_ranks_gap_withdraws_everything_announced(make_scheduler: Any) -> None:
    sched = make_scheduler()
    meta = _first_step(sched, _request("g", prompt(6, 2 * CHUNK_TOKENS + 1)), list(range(10, 20)))
    _land_all(sched, meta)
    assert len(_stored(sched.take_events())) == 2
    assert _residency(sched, gaps=(0,)) == [("BlockRemoved", "CPU")] * 2
    assert sched.events.announced == 0


def test_chunks_found_in_the_store_are_announced_in_their_tier(make_scheduler: Any, tmp_path: Path) -> None:
    """Another engine saved the prompt's chunks (the store holds two on SSD only, two in DRAM):
    this engine's planned load announces each, described from its own request, in its tier."""
    sched = make_scheduler()
    tokens = prompt(7, 4 * CHUNK_TOKENS + 1)
    keys = sched.object_keys(sched.chunk_hashes(_request("probe", tokens), 4))[0]
    with served_on_two_tiers(sched, keys, tmp_path):
        req = _request("B", tokens)
        hit = _ask(sched, req, 0)
        assert hit == 4 * CHUNK_TOKENS
        sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(x) for x in range(300, 310)],)), hit)
        got = _stored(sched.take_events())
        bpc = CHUNK_TOKENS // BLOCK
        assert [(e.medium, e.token_ids) for e in got] == [
            ("STORAGE", tokens[0:CHUNK_TOKENS]), ("STORAGE", tokens[CHUNK_TOKENS:2 * CHUNK_TOKENS]),
            ("CPU", tokens[2 * CHUNK_TOKENS:3 * CHUNK_TOKENS]), ("CPU", tokens[3 * CHUNK_TOKENS:4 * CHUNK_TOKENS])]
        assert got[2].block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[2 * bpc:3 * bpc]]
        sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(x) for x in range(300, 310)],)), hit)
        assert sched.take_events() == []  # announced once


def _out(sched: SchedulerSide, saves=(), residency=(), steps=()) -> list[tuple[str, str]]:  # noqa: ANN001
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=list(steps), saves=list(saves), residency=list(residency))))
    return [(type(e).__name__, e.medium) for e in sched.take_events()]


def test_a_save_that_found_the_chunk_stored_does_not_announce_dram(make_scheduler: Any) -> None:
    """EXISTS: the rank's copy may be on SSD only; CPU waits until its DRAM holds it again."""
    sched = make_scheduler()
    req = _request("e", prompt(8, CHUNK_TOKENS + 1))
    meta = _first_step(sched, req, list(range(10, 20)))
    [(_, sid, _)] = _saves(meta)
    h = sched.chunk_hashes(req, 1)[0]
    assert _out(sched, saves=[SaveReport(sid, 0, True, exists=True)], steps=[meta.step]) == []
    assert _out(sched, residency=[ResidencyReport(0, h, "ssd+")]) == [("BlockStored", "STORAGE")]
    assert _out(sched, residency=[ResidencyReport(0, h, "dram+")]) == [("BlockStored", "CPU")]


def test_saves_planned_before_a_reset_announce_nothing_after_it(make_scheduler: Any) -> None:
    sched = make_scheduler()
    tokens = prompt(9, CHUNK_TOKENS + 1)
    m1 = _first_step(sched, _request("old", tokens), list(range(10, 20)))
    [(_, s_old, _)] = _saves(m1)
    assert sched.reset_cache()
    m2 = _first_step(sched, _request("new", tokens), list(range(30, 40)))  # the same chunk hash, epoch 1
    [(_, s_new, _)] = _saves(m2)
    h = sched.chunk_hashes(_request("probe", tokens), 1)[0]
    assert _out(sched, saves=[SaveReport(s_old, 0, True)], steps=[m1.step]) == []  # epoch 0's save
    assert _out(sched, saves=[SaveReport(s_old, 0, False)]) == []  # (a late failure changes nothing)
    assert _out(sched, residency=[ResidencyReport(0, h, "ssd+", epoch=0)]) == []  # epoch 0's key
    assert _out(sched, saves=[SaveReport(s_new, 0, True)], steps=[m2.step]) == [("BlockStored", "CPU")]


def test_one_of_two_saves_of_a_chunk_failing_keeps_the_other(make_scheduler: Any) -> None:
    sched = make_scheduler()
    tokens = prompt(10, CHUNK_TOKENS + 1)
    a, b = _request("A", tokens), _request("B", tokens)
    for r in (a, b):
        sched.get_num_new_matched_tokens(r, 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(a, (list(range(10, 20)),)),
                              NewRequestData.from_request(b, (list(range(30, 40)),))]
    out.num_scheduled_tokens = {"A": a.num_tokens, "B": b.num_tokens}
    a.num_computed_tokens, b.num_computed_tokens = a.num_tokens, b.num_tokens
    meta = sched.build_connector_meta(out)
    (_, sa, _), (_, sb, _) = _saves(meta)
    assert _out(sched, saves=[SaveReport(sa, 0, False), SaveReport(sb, 0, True)], steps=[meta.step]) == [
        ("BlockStored", "CPU")]


def test_a_chunk_removed_before_its_save_landed_is_announced_when_put_again(make_scheduler: Any) -> None:
    sched = make_scheduler()
    tokens = prompt(11, CHUNK_TOKENS + 1)
    req = _request("g", tokens)
    meta = _first_step(sched, req, list(range(10, 20)))
    [(_, sid, _)] = _saves(meta)
    h = sched.chunk_hashes(req, 1)[0]
    assert _out(sched, residency=[ResidencyReport(0, h, "gone")]) == []
    assert _out(sched, saves=[SaveReport(sid, 0, True)], steps=[meta.step]) == []  # gone on rank 0
    assert _out(sched, residency=[ResidencyReport(0, h, "dram+")]) == [("BlockStored", "CPU")]  # put again


def test_a_chunk_found_on_another_node_is_remote_until_every_rank_keeps_it() -> None:
    """A load planned from the pool announces the chunk in CPU with locality REMOTE; once every
    rank's store keeps its local copy, CPU LOCAL is announced and the remote one withdrawn; a
    failed load withdraws whatever is announced."""
    from vllm_plugin.kv_events import ConnectorEvents

    req = _request("p", prompt(8, 2 * CHUNK_TOKENS + 1))
    ev = ConnectorEvents(BLOCK, CHUNK_TOKENS // BLOCK, num_ranks=2)
    h = "chunk-0"
    ev.found(req, 0, h, "pool")

    def said() -> list[tuple[str, str, str]]:
        return [(type(e).__name__, e.medium, e.locality) for e in ev.take()]

    assert said() == [("BlockStored", "CPU", "REMOTE")]
    ev.changed(0, h, "dram+")
    assert said() == []  # rank 1 has no local copy yet
    ev.changed(1, h, "dram+")
    assert said() == [("BlockRemoved", "CPU", "REMOTE"), ("BlockStored", "CPU", "LOCAL")]
    ev.changed(1, h, "dram-")  # evicted locally: reachable over the pool again, as far as this engine knows
    assert said() == [("BlockRemoved", "CPU", "LOCAL"), ("BlockStored", "CPU", "REMOTE")]
    ev.gone([h])
    assert said() == [("BlockRemoved", "CPU", "REMOTE")]


def test_a_routers_query_finds_vllms_own_events_by_lora_and_cache_salt(make_scheduler: Any) -> None:
    """vLLM's own block pool (GPU) and the connector (CPU) describe a request with a LoRA adapter
    and a cache salt; the index keys both through vLLM's wire format, and a query naming the same
    adapter and salt (``prompt_keys``, as the router asks) matches every block of the prompt, in
    both media. Another salt, no salt, or no adapter match nothing."""
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch
    from vllm.v1.core.block_pool import BlockPool

    from mooncake_kv.index.service import IndexConfig, KVIndex
    from store_backend.events.wire import AllBlocksCleared, KVEventBatch, decode_batch

    lora = LoRARequest("ad", 3, "/nonexistent")
    tokens = prompt(11, 2 * CHUNK_TOKENS + 5)
    req = Request("s", tokens, SamplingParams(max_tokens=4), None, lora_request=lora, cache_salt="tenant-1",
                  block_hasher=get_request_block_hasher(BLOCK, HASH_FN))
    n_blocks = len(tokens) // BLOCK
    pool = BlockPool(n_blocks + 4, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(req, pool.get_new_blocks(n_blocks), 0, n_blocks, BLOCK, 0)
    sched = make_scheduler()
    _land_all(sched, _first_step(sched, req, list(range(10, 10 + n_blocks))))
    wire = msgspec.msgpack.Encoder()
    index = KVIndex(IndexConfig(chunk_tokens=CHUNK_TOKENS))
    try:
        for events in (pool.take_events(), sched.take_events()):
            assert events
            index.apply("engine", decode_batch(wire.encode(VllmBatch(ts=0.0, events=events))))
        got = index.query_tokens(tokens, lora_name="ad", cache_salt="tenant-1").instances["engine"]
        assert got.matched_tokens == n_blocks * BLOCK
        assert got.tokens_by_medium == {"GPU": n_blocks * BLOCK}  # each block counted in its fastest medium
        index.apply("engine", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))  # the GPU's gone: the chunks stay
        got = index.query_tokens(tokens, lora_name="ad", cache_salt="tenant-1").instances["engine"]
        assert got.tokens_by_medium == {"CPU": 2 * CHUNK_TOKENS}
        for lora_name, salt in (("ad", "tenant-2"), ("ad", None), (None, "tenant-1"), (None, None)):
            assert index.query_tokens(tokens, lora_name=lora_name, cache_salt=salt).instances == {}, (lora_name, salt)
    finally:
        index.close()
