"""The scheduler half's save planning, driven with vLLM's own objects (``VllmConfig`` from
``EngineArgs``, ``Request``, ``SchedulerOutput``, ``KVConnectorOutput``) the way vLLM's scheduler
drives it, without an engine: what is planned, what is planned again, when blocks are released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.config import load_connector_config  # noqa: E402
from mooncake_connector.lookup_service import LookupServer  # noqa: E402
from store_backend.store import TieredStore  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt  # noqa: E402
from tests.vllm_plugin.tiny_model import write_tiny_llama  # noqa: E402
from vllm_plugin.metadata import SaveReport, TieredConnectorMetadata, TieredWorkerMetadata  # noqa: E402
from vllm_plugin.model_info import KVGeometry  # noqa: E402
from vllm_plugin.scheduler import DO_REMOTE_DECODE, REMOTE_PREFIX_TOKENS, SchedulerSide  # noqa: E402

BLOCK = 32
GEOMETRY = KVGeometry(block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="float32",
                      element_bytes=4, is_mla=False, shard_count=1)


@pytest.fixture(scope="module")
def make_scheduler(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    sockets = tmp_path_factory.mktemp("sockets")
    extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(sockets)}
    configs = {}
    for role in ("kv_both", "kv_producer"):
        ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role=role,
                               kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra)
        configs[role] = EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, block_size=BLOCK,
                                   dtype="float32", max_model_len=4096, enforce_eager=True,
                                   kv_transfer_config=ktc).create_engine_config()

    def make(role: str) -> SchedulerSide:
        return SchedulerSide(configs[role], load_connector_config(extra), GEOMETRY)

    return make


def _request(req_id: str, tokens: list[int], **kv_transfer_params: Any) -> Request:
    # As vLLM's API server passes them: in the sampling params' extra_args.
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(req_id, tokens, SamplingParams(max_tokens=4, extra_args=extra), None)


def _first_step(sched: SchedulerSide, req: Request, blocks: list[int]) -> TieredConnectorMetadata:
    """Step 1: the whole prompt is scheduled at once on ``blocks``."""
    sched.get_num_new_matched_tokens(req, 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
    out.num_scheduled_tokens = {req.request_id: req.num_tokens}
    req.num_computed_tokens = req.num_tokens
    return sched.build_connector_meta(out)


def _next_step(sched: SchedulerSide, req: Request | None = None, computed: int = 0) -> TieredConnectorMetadata:
    out = SchedulerOutput.make_empty()
    if req is not None:
        out.scheduled_cached_reqs = CachedRequestData(
            req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
            new_block_ids=[None], num_computed_tokens=[computed], num_output_tokens=[0])
        out.num_scheduled_tokens = {req.request_id: req.num_tokens - computed}
    return sched.build_connector_meta(out)


def _saves(meta: TieredConnectorMetadata) -> list[tuple[int, int, bool]]:
    """(first block, save id, hold) of every planned save."""
    return [(s.block_ids[0], s.save_id, s.hold) for plan in meta.requests for s in plan.saves]


def test_a_chunk_that_failed_to_load_is_planned_again_when_recomputed(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")
    req = _request("r", prompt(1, 300))
    blocks = list(range(100, 110))
    meta = _first_step(sched, req, blocks)
    assert [b for b, _i, _h in _saves(meta)] == [100, 102, 104, 106]  # chunks 0-3
    # A later load into block 103 (chunk 1) failed, as vLLM's aggregated output reports it: vLLM
    # recomputes from there, and chunks 1-3 must be saved again (the damaged copy is gone).
    sched.update_connector_output(KVConnectorOutput(
        invalid_block_ids={103},
        kv_connector_worker_meta=TieredWorkerMetadata(steps=[meta.step],
                                                      saves=[SaveReport(i, 0, True) for _b, i, _h in _saves(meta)])))
    meta2 = _next_step(sched, req, computed=64)
    assert [b for b, _i, _h in _saves(meta2)] == [102, 104, 106]


def test_a_save_that_did_not_land_is_planned_again(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_both")
    req = _request("r", prompt(2, 300))
    meta = _first_step(sched, req, list(range(10)))
    ids = [i for _b, i, _h in _saves(meta)]
    reports = [SaveReport(ids[0], 0, True), SaveReport(ids[1], 0, True), SaveReport(ids[2], 0, False),
               SaveReport(ids[3], 0, True)]
    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=TieredWorkerMetadata(steps=[meta.step], saves=reports)))
    assert sched.stats()["saves_landed"] == 3
    meta2 = _next_step(sched, req, computed=req.num_tokens - 1)
    assert [b for b, _i, _h in _saves(meta2)] == [4, 6]  # chunk 2 (no staging on a rank) and after


def test_prefill_request_keeps_its_blocks_until_every_save_landed(make_scheduler: Any) -> None:
    sched = make_scheduler("kv_producer")
    req = _request("p", prompt(3, 300), **{DO_REMOTE_DECODE: True})
    blocks = list(range(20, 30))
    meta = _first_step(sched, req, blocks)
    ids = [i for _b, i, _h in _saves(meta)]
    delay, params = sched.request_finished(req, blocks)
    assert delay and params[REMOTE_PREFIX_TOKENS] == 4 * CHUNK_TOKENS
    assert sched.has_pending_work()
    # Chunk 2's save did not land: it is planned again from the kept blocks, and nothing released.
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=[meta.step], saves=[SaveReport(i, 0, i != ids[2]) for i in ids])))
    meta2 = _next_step(sched)
    assert [b for b, _i, _h in _saves(meta2)] == [24, 26] and meta2.release == []
    # Once those landed, the next step releases the blocks to vLLM (get_finished on the workers).
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=[meta2.step], saves=[SaveReport(i, 0, True) for _b, i, _h in _saves(meta2)])))
    meta3 = _next_step(sched)
    assert meta3.release == ["p"] and not sched.has_pending_work()


def test_a_step_planned_before_the_load_outcome_holds_its_saves(make_scheduler: Any) -> None:
    """Async scheduling: step 2 is planned before step 1's output says whether its loads worked."""
    sched = make_scheduler("kv_both")
    with TieredStore({"dram": {"capacity_bytes": "4MiB"}}) as store:
        client = KVClient(store).start()
        server = LookupServer(client, sched.lookups[0].path).start()
        try:
            req = _request("r", prompt(4, 400))
            # The store holds the request's first four chunks (keys as the scheduler derives them).
            keys = sched.object_keys(sched.chunk_hashes(req, 4))[0]
            assert all(st.ok for st in client.save(keys, [np.zeros(64, np.uint8)] * 4).result(10))
            deadline = time.monotonic() + 10
            while (hit := sched.get_num_new_matched_tokens(req, 0)[0]) is None and time.monotonic() < deadline:
                time.sleep(0.01)  # poll interval; the loop has a deadline
            assert hit == 4 * CHUNK_TOKENS
            blocks = list(range(200, 213))
            sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), hit)
            # Step 1 loads chunks 0-3 and computes chunk 4 (chunked prefill: 64 tokens).
            req.num_computed_tokens = hit
            out = SchedulerOutput.make_empty()
            out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
            out.num_scheduled_tokens = {"r": 64}
            step1 = sched.build_connector_meta(out)
            assert [len(p.loads) for p in step1.requests] == [4]
            # Step 2 is planned before step 1's output: chunk 5 depends on step 1's loads too.
            step2 = _next_step(sched, req, computed=hit + 64)
            held = [i for meta in (step1, step2) for _b, i, hold in _saves(meta) if hold]
            assert [b for meta in (step1, step2) for b, _i, _h in _saves(meta)] == [208, 210]
            assert len(held) == 2  # both held: nothing computed over the loads is stored yet
            # Step 1's output: block 201 (chunk 0) failed on some rank. Both held saves are dropped.
            sched.update_connector_output(KVConnectorOutput(
                invalid_block_ids={201}, kv_connector_worker_meta=TieredWorkerMetadata(steps=[step1.step])))
            step3 = _next_step(sched)
            assert (step3.commit_saves, step3.discard_saves) == ([], held)
        finally:
            server.close()
            client.close()


def test_prefill_request_with_held_saves_keeps_stepping_until_they_are_committed(make_scheduler: Any) -> None:
    """A disaggregated-prefill request that loaded a prefix and finished in the same step: its new
    chunks are held (the loads are unconfirmed), so it keeps its blocks, and the connector asks vLLM
    to keep stepping until the commit reached the workers and the saves landed."""
    sched = make_scheduler("kv_producer")
    with TieredStore({"dram": {"capacity_bytes": "4MiB"}}) as store:
        client = KVClient(store).start()
        server = LookupServer(client, sched.lookups[0].path).start()
        try:
            req = _request("p", prompt(5, 400), **{DO_REMOTE_DECODE: True})
            keys = sched.object_keys(sched.chunk_hashes(req, 4))[0]
            assert all(st.ok for st in client.save(keys, [np.zeros(64, np.uint8)] * 4).result(10))
            deadline = time.monotonic() + 10
            while (hit := sched.get_num_new_matched_tokens(req, 0)[0]) is None and time.monotonic() < deadline:
                time.sleep(0.01)  # poll interval; the loop has a deadline
            assert hit == 4 * CHUNK_TOKENS
            blocks = list(range(300, 313))
            sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(b) for b in blocks],)), hit)
            req.num_computed_tokens = hit
            out = SchedulerOutput.make_empty()
            out.scheduled_new_reqs = [NewRequestData.from_request(req, (blocks,))]
            out.num_scheduled_tokens = {"p": req.num_tokens - hit}
            step1 = sched.build_connector_meta(out)
            held = _saves(step1)
            assert [(b, h) for b, _i, h in held] == [(308, True), (310, True)]  # chunks 4-5, held
            req.num_computed_tokens = req.num_tokens
            delay, params = sched.request_finished(req, blocks)  # max_tokens=1: done in step 1
            assert delay and params[REMOTE_PREFIX_TOKENS] == 6 * CHUNK_TOKENS
            # Step 1's output: the loads were fine. The commit must still reach the workers.
            sched.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=TieredWorkerMetadata(steps=[step1.step])))
            assert sched.has_pending_work()
            step2 = _next_step(sched)
            assert step2.commit_saves == [i for _b, i, _h in held] and step2.release == []
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
                steps=[step2.step], saves=[SaveReport(i, 0, True) for _b, i, _h in held])))
            step3 = _next_step(sched)
            assert step3.release == ["p"] and not sched.has_pending_work()
        finally:
            server.close()
            client.close()


class _GatedPuts:
    """Fault injection: a store whose puts wait for ``gate`` (a slow device), so saves stay in
    flight while the scheduler looks the same chunks up for another request."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def put(self, keys: Any, buffers: Any, parents: Any = None) -> Any:
        self.gate.wait(30)
        return self.inner.put(keys, buffers, parents)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _in_flight_prefix(sched: SchedulerSide, client: KVClient, tokens: list[int], blocks: list[int]) -> tuple[
        Request, TieredConnectorMetadata]:
    """Request A computes ``tokens`` on ``blocks``; its saves are handed to the (slow) store, as the
    worker's wait_for_save does, and A finishes (an ordinary request: its blocks are freed)."""
    a = _request("A", tokens)
    meta = _first_step(sched, a, blocks)
    keys = sched.object_keys([s.chunk_hash for plan in meta.requests for s in plan.saves])[0]
    client.save(keys, [np.zeros(64, np.uint8)] * len(keys))
    assert sched.request_finished(a, blocks) == (False, None)
    return a, meta


def _ask(sched: SchedulerSide, req: Request, computed: int) -> int:
    deadline = time.monotonic() + 10
    while (hit := sched.get_num_new_matched_tokens(req, computed)[0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval; the loop has a deadline
    assert hit is not None
    return hit


@contextlib.contextmanager
def _gated_lookup(sched: SchedulerSide) -> Iterator[KVClient]:
    """A client over a DRAM store whose puts wait for a gate (opened at exit), served on the
    scheduler's lookup socket, so saves stay in flight while the scheduler plans."""
    with TieredStore({"dram": {"capacity_bytes": "4MiB"}}) as store:
        slow = _GatedPuts(store)
        client = KVClient(slow).start()
        server = LookupServer(client, sched.lookups[0].path).start()
        try:
            yield client
        finally:
            slow.gate.set()
            server.close()
            client.close()


def _fail_all(sched: SchedulerSide, meta: TieredConnectorMetadata) -> None:
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=[meta.step], saves=[SaveReport(i, 0, False) for _b, i, _h in _saves(meta)])))


def _land_all(sched: SchedulerSide, meta: TieredConnectorMetadata) -> None:
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
        steps=[meta.step], saves=[SaveReport(i, 0, True) for _b, i, _h in _saves(meta)])))


def test_a_failed_save_another_request_counted_on_is_planned_again_by_it(make_scheduler: Any) -> None:
    """B's lookup counts A's saves in flight as present (vLLM's prefix cache gives B A's blocks).
    A has finished when its saves fail: B, which still holds the blocks, saves those chunks."""
    sched = make_scheduler("kv_producer")
    with _gated_lookup(sched) as client:
        tokens = prompt(6, 300)
        blocks_a = list(range(10, 17))
        _a, meta_a = _in_flight_prefix(sched, client, tokens[:200], blocks_a)
        b = _request("B", tokens, **{DO_REMOTE_DECODE: True})
        _ask(sched, b, 192)  # vLLM's local hit: A's first six blocks
        assert sched.tracked("B").hit_chunks == 3  # A's three saves in flight count as present
        blocks_b = blocks_a[:6] + [30, 31, 32, 33]
        sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(x) for x in blocks_b],)), 0)
        _fail_all(sched, meta_a)
        b.num_computed_tokens = 192
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(b, (blocks_b,))]
        out.num_scheduled_tokens = {"B": 300 - 192}
        meta_b = sched.build_connector_meta(out)
        assert [blk for blk, _i, _h in _saves(meta_b)] == [10, 12, 14, 30]  # chunks 0-3, from B's blocks
        b.num_computed_tokens = 300
        delay, params = sched.request_finished(b, blocks_b)
        assert delay and params[REMOTE_PREFIX_TOKENS] == 4 * CHUNK_TOKENS


def test_a_prefill_request_keeps_its_blocks_until_saves_it_counted_on_settled(make_scheduler: Any) -> None:
    """Disaggregated prefill B promises chunks that only A's saves in flight stand for. Its own save
    lands first; B still keeps its blocks until A's saves settle. They fail: B saves those chunks
    from its blocks and releases them only once they landed, so the decode side gets its promise."""
    sched = make_scheduler("kv_producer")
    with _gated_lookup(sched) as client:
        tokens = prompt(7, 260)
        blocks_a = list(range(40, 47))
        _a, meta_a = _in_flight_prefix(sched, client, tokens[:200], blocks_a)
        b = _request("B", tokens, **{DO_REMOTE_DECODE: True})
        _ask(sched, b, 192)
        assert sched.tracked("B").hit_chunks == 3
        blocks_b = blocks_a[:6] + [50, 51, 52]
        sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(x) for x in blocks_b],)), 0)
        b.num_computed_tokens = 192
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(b, (blocks_b,))]
        out.num_scheduled_tokens = {"B": 260 - 192}
        step1 = sched.build_connector_meta(out)
        assert [blk for blk, _i, _h in _saves(step1)] == [50]  # chunk 3 only: 0-2 are A's, in flight
        b.num_computed_tokens = 260
        delay, params = sched.request_finished(b, blocks_b)
        assert delay and params[REMOTE_PREFIX_TOKENS] == 4 * CHUNK_TOKENS
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
            steps=[step1.step], saves=[SaveReport(i, 0, True) for _b, i, _h in _saves(step1)])))
        step2 = _next_step(sched)
        assert step2.release == [], "B released its blocks while saves it promised were in flight"
        _fail_all(sched, meta_a)
        step3 = _next_step(sched)
        # Chunks 0-3 from B's blocks (saved_chunks is a prefix: chunk 3 again, stored EXISTS).
        assert [blk for blk, _i, _h in _saves(step3)] == [40, 42, 44, 50] and step3.release == []
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TieredWorkerMetadata(
            steps=[step3.step], saves=[SaveReport(i, 0, True) for _b, i, _h in _saves(step3)])))
        assert _next_step(sched).release == ["B"]


def test_with_draft_kv_a_decode_chunk_ending_at_the_last_token_waits_for_the_next(
        tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With EAGLE/MTP/draft-model speculation the draft layers' KV of the last accepted position
    may be rewritten after a rejection (vLLM's own offloading connector holds that chunk back too):
    during decode a chunk ending at the last known token is saved one step later, once it is
    followed by another; without draft KV it is saved at once."""
    draft = write_tiny_llama(tmp_path_factory.mktemp("draft"), num_layers=1, seed=9)
    extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(tmp_path_factory.mktemp("sockets"))}
    ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role="kv_both",
                           kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra)

    def chunks_saved(spec: dict | None) -> list[int]:
        args: dict[str, Any] = {"model": str(tiny_model), "skip_tokenizer_init": True, "block_size": BLOCK,
                                "dtype": "float32", "max_model_len": 4096, "enforce_eager": True,
                                "kv_transfer_config": ktc}
        if spec is not None:
            args["speculative_config"] = spec
        sched = SchedulerSide(EngineArgs(**args).create_engine_config(), load_connector_config(extra), GEOMETRY)
        try:
            req = Request("d", prompt(21, 2 * CHUNK_TOKENS), SamplingParams(max_tokens=4 * CHUNK_TOKENS), None)
            saved = [len(_saves(_first_step(sched, req, list(range(8)))))]  # prefill: chunks 0 and 1
            computed = req.num_computed_tokens
            for n in (CHUNK_TOKENS, 1):  # decode: chunk 2 completes at the last token, then one more
                req.append_output_token_ids(list(range(1, n + 1)))
                saved.append(len(_saves(_next_step(sched, req, computed))))
                computed = req.num_tokens
            return saved
        finally:
            sched.close()

    assert chunks_saved(None) == [2, 1, 0]
    assert chunks_saved({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}) == [2, 0, 1]


def test_with_draft_kv_the_held_back_chunk_is_saved_when_the_request_finishes(
        tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A decode chunk ending at the last known token is held back with draft KV; when the request
    finishes in that step, its chunks up to ``num_computed_tokens`` are final: ``request_finished``
    keeps the blocks (vLLM's delayed free), the next step saves the held chunk from them (once: a
    failed save is planned again, a landed one releases the blocks), as vLLM's offloading connector
    stores that chunk at finish. A request with nothing held back is freed at once, as before."""
    draft = write_tiny_llama(tmp_path_factory.mktemp("draft"), num_layers=1, seed=9)
    extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(tmp_path_factory.mktemp("sockets"))}
    ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role="kv_both",
                           kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra)
    config = EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, block_size=BLOCK, dtype="float32",
                        max_model_len=4096, enforce_eager=True, kv_transfer_config=ktc,
                        speculative_config={"method": "draft_model", "model": str(draft),
                                            "num_speculative_tokens": 2}).create_engine_config()
    sched = SchedulerSide(config, load_connector_config(extra), GEOMETRY)

    def decode_and_finish(req: Request, blocks: list[int], n_decoded: int) -> tuple[list[int], Any]:
        """Prefill, one decode step computing ``n_decoded`` more tokens, the sampled token appended
        and the request finished (max_tokens): the chunks each step saved and request_finished's answer."""
        steps = [_first_step(sched, req, blocks)]
        computed = req.num_computed_tokens
        req.append_output_token_ids(list(range(1, n_decoded + 1)))
        steps.append(_next_step(sched, req, computed))
        req.num_computed_tokens = req.num_tokens
        for step in steps:  # those saves landed
            _land_all(sched, step)
        req.append_output_token_ids([7])  # the token sampled by that step: known, not computed
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return [len(_saves(step)) for step in steps], sched.request_finished(req, blocks)

    try:
        req = Request("d", prompt(22, 2 * CHUNK_TOKENS), SamplingParams(max_tokens=CHUNK_TOKENS + 1), None)
        blocks = list(range(40, 48))
        saved, finished = decode_and_finish(req, blocks, CHUNK_TOKENS)
        assert saved == [2, 0]  # chunk 2 ends at the last known token: held back
        assert finished == (True, None) and sched.has_pending_work()
        hashes = sched.finishing("d").hashes
        step = _next_step(sched)  # the request is no longer scheduled: its kept blocks are saved
        saves = [s for plan in step.requests for s in plan.saves]
        assert [(s.chunk_hash, s.parent_hash, s.block_ids) for s in saves] == [(hashes[2], hashes[1], [44, 45])]
        assert step.release == []
        # The save did not land: planned again from the same blocks, nothing released yet.
        _fail_all(sched, step)
        step = _next_step(sched)
        assert [b for b, _i, _h in _saves(step)] == [44] and step.release == []
        _land_all(sched, step)
        step = _next_step(sched)
        assert _saves(step) == [] and step.release == ["d"] and not sched.has_pending_work()
        assert sched.counters["save_chunks"] == 4  # chunks 0-2, and chunk 2 once more after its failure
        assert _saves(_next_step(sched)) == []

        # Chunk 2 saved during decode (another token followed it): nothing held, blocks freed at once.
        other = Request("e", prompt(23, 2 * CHUNK_TOKENS), SamplingParams(max_tokens=CHUNK_TOKENS + 2), None)
        saved, finished = decode_and_finish(other, list(range(60, 68)), CHUNK_TOKENS + 1)
        assert saved == [2, 1] and finished == (False, None) and not sched.has_pending_work()

        # Disaggregated prefill that decoded: the held chunk is in the promise and saved before release.
        pd = _request("p", prompt(24, 2 * CHUNK_TOKENS), **{DO_REMOTE_DECODE: True})
        saved, (delay, params) = decode_and_finish(pd, list(range(80, 88)), CHUNK_TOKENS)
        assert saved == [2, 0] and delay and params[REMOTE_PREFIX_TOKENS] == 3 * CHUNK_TOKENS
        assert [b for b, _i, _h in _saves(_next_step(sched))] == [84]
    finally:
        sched.close()


def test_a_decode_request_keyed_for_another_layout_is_computed_here_with_a_warning(make_scheduler: Any,
                                                                                   caplog: Any) -> None:
    """A prefill instance of another tensor-parallel size (or model, dtype, chunk_tokens, epoch)
    stores under another fingerprint: the decode side waits for nothing, says why once, and counts
    it; a malformed token count is refused by name, not raised into vLLM's scheduler."""
    import logging

    sched = make_scheduler("kv_both")
    tokens = prompt(77, 3 * CHUNK_TOKENS + 1)
    with caplog.at_level(logging.WARNING, logger="vllm_plugin.scheduler"):
        for i in range(2):
            req = _request(f"d{i}", tokens, do_remote_prefill=True, remote_prefix_tokens=3 * CHUNK_TOKENS,
                           remote_fingerprint="0123456789abcdef")
            t = sched.track(req)
            assert (t.remote_chunks, t.remote_deadline) == (0, 0.0)
        bad = sched.track(_request("bad", tokens, do_remote_prefill=True, remote_prefix_tokens="many"))
        assert bad.remote_chunks == 0
        huge = sched.track(_request("inf", tokens, do_remote_prefill=True, remote_prefix_tokens=float("inf")))
        assert huge.remote_chunks == 0
    assert sched.stats()["remote_fingerprint_mismatch"] == 2
    said = [r.getMessage() for r in caplog.records]
    assert sum("0123456789abcdef" in m and "tensor-parallel size" in m for m in said) == 1
    assert any("remote_prefix_tokens='many' is not a token count" in m for m in said)
    good = sched.track(_request("ok", tokens, do_remote_prefill=True, remote_prefix_tokens=3 * CHUNK_TOKENS,
                                remote_fingerprint=sched.shard_digests[0]))
    assert good.remote_chunks == 3 and good.remote_deadline > 0
    sched.close()
