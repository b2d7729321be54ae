"""A disaggregated decode's prefix loaded beside the steps, through vLLM's own scheduler.

vLLM's :class:`vllm.v1.core.sched.scheduler.Scheduler` (with this connector in its scheduler role,
built by vLLM's connector factory) and a real :class:`vllm_plugin.worker.WorkerSide` (a real store,
real paged CPU tensors), joined as vLLM's engine joins them: each step's metadata goes to the
worker, whose hooks run as the model runner calls them, and the worker's answers (``get_finished``,
the load errors, its report) come back in a ``ModelRunnerOutput``. No model runs: sampled tokens are
made up, the KV bytes are the point.

A plain request computes the prompt and its chunks are saved; vLLM's prefix cache is reset and the
cache pages overwritten; then the decode request (``do_remote_prefill``) must park in
``WAITING_FOR_REMOTE_KVS`` while another request keeps decoding, join the batch with the loaded
prefix counted as computed, and find the saved bytes in its blocks; alone, it loads in its step. A
chunk that fails is recomputed from its first block; an abort during the load frees the blocks only
once the load ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.config import load_connector_config  # noqa: E402
from mooncake_connector.epoch import EpochFile  # noqa: E402
from mooncake_connector.layout import PageFormat, PagedLayer  # noqa: E402
from mooncake_connector.lookup_service import LookupServer, socket_path  # noqa: E402
from mooncake_connector.staging import StagingPool  # noqa: E402
from mooncake_connector.stores import epoch_directory  # noqa: E402
from store_backend.slots import SlotLease  # noqa: E402
from store_backend.types import Status  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt  # noqa: E402
from tests.vllm_plugin.worker_objects import (  # noqa: E402
    BLOCK,
    GEOMETRY,
    LAYERS,
    cache_config,
    connector_config,
    single_process_groups,
)
from vllm_plugin.metadata import TieredConnectorMetadata  # noqa: E402
from vllm_plugin.model_info import shard_fingerprints, weights_identity  # noqa: E402
from vllm_plugin.parallel import lookup_name  # noqa: E402
from vllm_plugin.worker import WorkerSide  # noqa: E402

NUM_BLOCKS = 40
PREFIX_CHUNKS = 3
PROMPT_TOKENS = PREFIX_CHUNKS * CHUNK_TOKENS + 1


class _Gate:
    """Fault injection: a lease waits for ``open`` (a slow remote read); with ``missing`` set, the
    next lease of several keys answers NOT_FOUND for its ``missing``-th key (a chunk gone since
    the lookup)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.missing: int | None = None

    def lease(self, keys: Sequence[str], **kwargs: Any) -> list[Any]:
        self.entered.set()
        assert self.open.wait(30), "gate never opened"
        leases = list(self.inner.lease(keys, **kwargs))
        i, self.missing = self.missing, None
        if i is not None and i < len(keys):
            if leases[i].status is Status.OK:
                self.inner.release([leases[i]])
            leases[i] = SlotLease(Status.NOT_FOUND, keys[i])
        return leases

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Engine:
    """vLLM's scheduler and one worker, stepped as vLLM's engine core steps them."""

    def __init__(self, sched: Scheduler, worker: WorkerSide, gate: _Gate) -> None:
        self.sched = sched
        self.w = worker
        self.gate = gate
        self.statuses: dict[str, set[RequestStatus]] = {}

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, TieredConnectorMetadata)
        w = self.w
        w.set_epoch(meta.epoch)
        if out.has_sync_kv_loads:
            w.start_load_kv(meta)
        for layer in LAYERS:  # the forward's hooks
            w.wait_for_layer_load(meta, layer)
            w.save_kv_layer(meta, layer)
        w.start_load_kv(meta)  # after the forward when no load is synchronous (a no-op otherwise)
        w.wait_for_save(meta)
        finished = w.take_finished_loads()
        errors = w.take_load_errors()
        report = w.build_worker_meta()
        req_ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[11] for _ in req_ids],
                                kv_connector_output=KVConnectorOutput(finished_recving=finished or None,
                                                                      invalid_block_ids=errors,
                                                                      kv_connector_worker_meta=report))
        self.sched.update_from_output(out, mro)
        for req_id, req in self.sched.requests.items():
            self.statuses.setdefault(req_id, set()).add(req.status)
        return out

    def until(self, what: str, cond: Any, timeout_s: float = 20.0) -> SchedulerOutput:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.step()
            if cond(out):
                return out
            time.sleep(0.002)  # an engine step; the loop has a deadline
        raise AssertionError(f"{what}: not within {timeout_s} s; worker {self.w.stats()}")

    def blocks(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def pages(self, blocks: list[int]) -> list[torch.Tensor]:
        return [p.kv[blocks].clone() for p in self.w.paged]


_HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(_HASH_FN)
_BLOCK_HASHER = get_request_block_hasher(BLOCK, _HASH_FN)  # as vLLM's engine core makes requests


def _request(req_id: str, tokens: list[int], max_tokens: int, **params: Any) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra), None,
                   block_hasher=_BLOCK_HASHER)


@pytest.fixture
def engine(tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Engine]:
    """The engine with ``remote_prefill_load`` the test's parameter (default "auto")."""
    extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(tmp_path), "load_timeout_s": 5.0,
             "store": {"dram": {"capacity_bytes": "16MiB"}}, "flush_on_close": False,
             "remote_prefill_load": getattr(request, "param", "auto")}
    vllm_config = connector_config(tiny_model, extra, max_model_len=1024, max_num_batched_tokens=1024,
                                   kv_load_failure_policy="recompute")
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after profiling
    kv_cache_config = cache_config(NUM_BLOCKS)
    cfg = load_connector_config(extra)
    with single_process_groups(vllm_config):
        w = WorkerSide(vllm_config, cfg, GEOMETRY, kv_cache_config)
        # What register_kv_caches derives from the engine's cache and model (no model is loaded here).
        w.paged = [PagedLayer(torch.randn(NUM_BLOCKS, 2, BLOCK, 128), PageFormat.KV_HALVES, num_heads=2,
                              head_size=64) for _ in LAYERS]
        w.staging = StagingPool(8 * w.layout.chunk_bytes)
        w.epochs.fingerprint = shard_fingerprints(vllm_config, GEOMETRY, cfg, stage=0,
                                                  weights=weights_identity(vllm_config, cfg))[0]
        w.epoch = EpochFile(epoch_directory(cfg, w.store)).read()
        w.digest = w.epochs.digest_at(w.epoch)
        gate = _Gate(w.store)
        w.client.close()
        w.client = KVClient(gate, io_workers=2).start()
        server = LookupServer(w.client, socket_path(lookup_name(vllm_config), 0, str(tmp_path))).start()
        sched = Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size=BLOCK)
        try:
            with set_current_vllm_config(vllm_config):
                yield _Engine(sched, w, gate)
        finally:
            gate.open.set()
            sched.shutdown()
            server.close()
            w.close()


def _prefill(e: _Engine, tokens: list[int]) -> list[torch.Tensor]:
    """A plain request computes ``tokens`` (its chunks saved); returns its prefix blocks' bytes.
    Then vLLM's prefix cache is reset and every page overwritten, so only the store holds them."""
    e.sched.add_request(_request("prefill", tokens, max_tokens=1))
    out = e.until("the prefill request scheduled", lambda out: "prefill" in out.num_scheduled_tokens)
    (new,) = out.scheduled_new_reqs
    want = e.pages(list(new.block_ids[0][:PREFIX_CHUNKS * CHUNK_TOKENS // BLOCK]))  # as the save gathered them
    e.until("the prefill request finished", lambda out: "prefill" not in e.sched.requests)
    assert e.w.flush(10)
    e.until("its saves reported", lambda out: e.sched.connector.stats()["save_chunks_landed"] >= PREFIX_CHUNKS)
    assert e.sched.reset_prefix_cache()
    for p in e.w.paged:
        p.kv.copy_(torch.randn_like(p.kv))
    return want


def test_a_decode_request_parks_while_others_decode_and_joins_with_its_prefix_loaded(engine: _Engine) -> None:
    """"auto" while another request decodes: the decode request parks until its slow load ends,
    the other request's steps go on meanwhile, and it joins with the prefix counted as computed
    and byte-equal in its blocks."""
    e = engine
    tokens = prompt(5, PROMPT_TOKENS)
    want = _prefill(e, tokens)
    e.sched.add_request(_request("other", prompt(6, 40), max_tokens=60))
    e.until("the other request decoding", lambda out: "other" in out.num_scheduled_tokens)
    e.gate.entered.clear()
    e.gate.open.clear()  # the decode's lease waits: a slow read from the prefill node
    e.sched.add_request(_request("decode", tokens, max_tokens=2, do_remote_prefill=True,
                                 remote_prefix_tokens=PREFIX_CHUNKS * CHUNK_TOKENS))
    e.until("the decode request parked", lambda out: e.sched.requests["decode"].status
            == RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert e.gate.entered.wait(10)
    decoded = len(e.sched.requests["other"].output_token_ids)
    for _ in range(5):  # the other request's steps go on while the load waits
        out = e.step()
        assert "decode" not in out.num_scheduled_tokens and "other" in out.num_scheduled_tokens
    assert len(e.sched.requests["other"].output_token_ids) == decoded + 5
    assert e.sched.requests["decode"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    e.gate.open.set()
    out = e.until("the decode request scheduled", lambda out: "decode" in out.num_scheduled_tokens)
    new = [r for r in out.scheduled_new_reqs if r.req_id == "decode"]
    assert new and new[0].num_computed_tokens == PREFIX_CHUNKS * CHUNK_TOKENS
    assert out.num_scheduled_tokens["decode"] == 1  # only the last prompt token is computed
    got = e.pages(e.blocks("decode")[:PREFIX_CHUNKS * CHUNK_TOKENS // BLOCK])
    for g, x in zip(got, want):
        assert torch.equal(g, x)
    st = e.sched.connector.stats()
    assert st["async_loads"] == 1
    assert e.w.stats()["chunks_loaded"] == PREFIX_CHUNKS and e.w.stats()["async_load_jobs"] == 1


def test_alone_the_prefix_loads_in_its_step(engine: _Engine) -> None:
    """"auto" with no other request running: nothing to hold up, so the load runs in the
    request's first step (overlapping that step's compute); the request never parks."""
    e = engine
    tokens = prompt(8, PROMPT_TOKENS)
    want = _prefill(e, tokens)
    e.sched.add_request(_request("decode", tokens, max_tokens=2, do_remote_prefill=True,
                                 remote_prefix_tokens=PREFIX_CHUNKS * CHUNK_TOKENS))
    out = e.until("the decode request scheduled", lambda out: "decode" in out.num_scheduled_tokens)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS not in e.statuses["decode"]
    assert out.has_sync_kv_loads
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [PREFIX_CHUNKS * CHUNK_TOKENS]
    for g, x in zip(e.pages(e.blocks("decode")[:PREFIX_CHUNKS * CHUNK_TOKENS // BLOCK]), want):
        assert torch.equal(g, x)
    assert e.sched.connector.stats()["async_loads"] == 0


@pytest.mark.parametrize("engine", ["async"], indirect=True)
def test_a_chunk_that_fails_is_recomputed_from_its_first_block(engine: _Engine) -> None:
    e = engine
    tokens = prompt(7, PROMPT_TOKENS)
    want = _prefill(e, tokens)
    e.gate.missing = 1  # the prefix's second chunk
    e.sched.add_request(_request("decode", tokens, max_tokens=2, do_remote_prefill=True,
                                 remote_prefix_tokens=PREFIX_CHUNKS * CHUNK_TOKENS))
    out = e.until("the decode request scheduled", lambda out: "decode" in out.num_scheduled_tokens)
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in e.statuses["decode"]
    new = [r for r in out.scheduled_new_reqs if r.req_id == "decode"]
    assert new and new[0].num_computed_tokens == CHUNK_TOKENS  # up to the failed chunk's first block
    assert out.num_scheduled_tokens["decode"] == PROMPT_TOKENS - CHUNK_TOKENS
    got = e.pages(e.blocks("decode")[:CHUNK_TOKENS // BLOCK])
    for g, x in zip(got, want):
        assert torch.equal(g, x[:CHUNK_TOKENS // BLOCK])


@pytest.mark.parametrize("engine", ["async"], indirect=True)
def test_an_abort_during_the_load_frees_the_blocks_once_the_load_ended(engine: _Engine) -> None:
    e = engine
    tokens = prompt(9, PROMPT_TOKENS)
    _prefill(e, tokens)
    pool = e.sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    e.gate.entered.clear()
    e.gate.open.clear()
    e.sched.add_request(_request("decode", tokens, max_tokens=2, do_remote_prefill=True,
                                 remote_prefix_tokens=PREFIX_CHUNKS * CHUNK_TOKENS))
    e.until("the decode request parked", lambda out: "decode" in e.sched.requests
            and e.sched.requests["decode"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert e.gate.entered.wait(10)
    e.sched.finish_requests("decode", RequestStatus.FINISHED_ABORTED)
    e.step()
    assert pool.get_num_free_blocks() < free_before  # the load may still write into them
    e.gate.open.set()
    e.until("the blocks freed", lambda out: pool.get_num_free_blocks() == free_before)
    assert e.w.stats()["async_loads_in_flight"] == 0
    assert e.w.store.stats().slots.held_bytes == 0
