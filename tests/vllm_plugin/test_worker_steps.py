"""The worker half's step lifecycle, driven the way vLLM's model runner drives it, without an engine:
a real :class:`vllm_plugin.worker.WorkerSide` (built from vLLM's ``VllmConfig`` and ``KVCacheConfig``
inside vLLM's own single-process distributed groups), a real store and real paged CPU tensors.

vLLM does not always call ``wait_for_save``: with speculative decoding it defers the call until
after the draft model, and a non-last pipeline rank returns before that point, so the call never
comes (``gpu_model_runner.py``: ``defer_kv_connector_finalize``, the early ``return hidden_states``
of non-last ranks, ``finalize_kv_connector`` only on the last rank). The next step must still see
that step's saves put (or reported not stored) and its staging returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

import torch  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.config import load_connector_config  # noqa: E402
from mooncake_connector.keys import object_key  # noqa: E402
from mooncake_connector.layout import PageFormat, PagedLayer  # noqa: E402
from mooncake_connector.staging import StagingPool  # noqa: E402
from tests.vllm_plugin.conftest import CHUNK_TOKENS  # noqa: E402
from tests.vllm_plugin.worker_objects import (  # noqa: E402
    BLOCK,
    GEOMETRY,
    LAYERS,
    cache_config,
    connector_config,
    single_process_groups,
)
from store_backend.types import Buffer, Status  # noqa: E402
from vllm_plugin.metadata import ChunkLoad, ChunkSave, RequestPlan, TieredConnectorMetadata  # noqa: E402
from vllm_plugin.worker import WorkerSide  # noqa: E402

NUM_BLOCKS = 32
CHUNK_BYTES = GEOMETRY.chunk_layout(CHUNK_TOKENS).chunk_bytes


@pytest.fixture(scope="module")
def make_worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    extra = {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(tmp_path_factory.mktemp("sockets")),
             "load_timeout_s": 0.5}
    vllm_config = connector_config(tiny_model, extra)
    kv_cache_config = cache_config(NUM_BLOCKS)
    workers: list[WorkerSide] = []

    def make(staging_chunks: int) -> WorkerSide:
        w = WorkerSide(vllm_config, load_connector_config(extra), GEOMETRY, kv_cache_config)
        # What register_kv_caches derives from the engine's allocated cache (vLLM CPU_ATTN pages).
        w.paged = [PagedLayer(torch.randn(NUM_BLOCKS, 2, BLOCK, 128), PageFormat.KV_HALVES, num_heads=2,
                              head_size=64) for _ in LAYERS]
        w.staging = StagingPool(staging_chunks * CHUNK_BYTES)
        w.digest = "test-digest"
        workers.append(w)
        return w

    with single_process_groups(vllm_config):
        yield make
        for w in workers:
            w.close()


def _step(step: int, first_block: int) -> TieredConnectorMetadata:
    """A step that saves one chunk (blocks ``first_block``, ``first_block + 1``)."""
    save = ChunkSave(f"chunk-{step}", None, [first_block, first_block + 1], save_id=step)
    return TieredConnectorMetadata(requests=[RequestPlan(f"r{step}", saves=[save])], step=step)


def _reports_until(w: WorkerSide, want: int, timeout_s: float = 10.0) -> dict[int, bool]:
    """Save outcomes reported by ``w`` until ``want`` of them came (save id -> stored)."""
    out: dict[int, bool] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out.update({r.save_id: r.ok for r in w.build_worker_meta().saves})
        time.sleep(0.01)  # poll interval; the loop has a deadline
    return out


def test_saves_of_a_step_without_wait_for_save_are_put_by_the_next_step(make_worker: Any) -> None:
    """Speculative decoding on a non-last pipeline rank: every layer hook runs, wait_for_save never
    does. Staging (four chunks) must not fill up step after step, and every save lands."""
    w = make_worker(staging_chunks=4)
    reports: dict[int, bool] = {}
    for step in range(1, 9):
        meta = _step(step, 2 * (step % 8))
        w.start_load_kv(meta)
        for layer in LAYERS:
            w.wait_for_layer_load(meta, layer)
            w.save_kv_layer(meta, layer)
        reports.update({r.save_id: r.ok for r in w.build_worker_meta().saves})  # before the finalize
    w.start_load_kv(TieredConnectorMetadata(step=9))  # the step after the last one ends it too
    assert w.flush(10)
    reports.update(_reports_until(w, 8 - len(reports)))
    assert reports == {step: True for step in range(1, 9)}  # none refused for want of staging
    assert w.staging is not None and w.staging.in_use_bytes == 0
    assert w.stats()["saves_not_stored"] == 0


def test_saves_no_hook_gathered_are_reported_not_stored_when_the_step_is_left(make_worker: Any) -> None:
    """A step entered (its loads started) whose save hooks and wait_for_save never ran: its saves
    never reached staging, and the engine's blocks may hold other KV by now. They are reported not
    stored, so the scheduler plans them again."""
    w = make_worker(staging_chunks=4)
    meta = _step(1, 0)
    w.start_load_kv(meta)
    w.build_worker_meta()
    w.start_load_kv(TieredConnectorMetadata(step=2))
    assert _reports_until(w, 1) == {1: False}
    assert w.staging is not None and w.staging.in_use_bytes == 0


class _StuckPuts:
    """Fault injection: a store whose puts hang until ``gate`` is set (a stuck device)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer], parents: Any = None) -> list[Status]:
        self.gate.wait(30)
        return self.inner.put(keys, buffers, parents)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_load_behind_stuck_saves_fails_within_the_load_timeout(make_worker: Any) -> None:
    """Every I/O batch slot is held by saves a stuck store never finishes. start_load_kv (vLLM's
    forward thread) must return within load_timeout_s, with the load's blocks reported as load
    errors (vLLM recomputes them), not block until the store recovers."""
    w = make_worker(staging_chunks=8)
    stuck = _StuckPuts(w.store)
    w.client.close()
    w.client = KVClient(stuck, io_workers=1, max_pending_batches=2).start()
    try:
        for i in range(2):
            w.client.save([f"stuck-{i}"], [np.zeros(8, np.uint8)])
        meta = TieredConnectorMetadata(requests=[RequestPlan("r", loads=[ChunkLoad("chunk-x", [4, 5])])], step=1)
        done = threading.Event()

        def forward() -> None:
            w.start_load_kv(meta)
            for layer in LAYERS:
                w.wait_for_layer_load(meta, layer)
            done.set()

        t0 = time.monotonic()
        threading.Thread(target=forward, daemon=True).start()
        assert done.wait(5.0), "start_load_kv blocked on the stuck store"
        assert time.monotonic() - t0 < 3 * w.cfg.load_timeout_s + 1
        assert w.take_load_errors() == {4, 5}
    finally:
        stuck.gate.set()
        w.wait_for_save(meta)


def test_a_held_save_committed_after_a_cache_reset_is_not_stored(make_worker: Any) -> None:
    """A save held for the scheduler's decision was keyed before a cache reset moved the worker to
    a new epoch (``set_epoch`` changes ``digest``). Committed afterwards, it must not be put under
    its old-epoch key (unreachable, and possibly after the reset's sweep) nor under the new one (its
    KV predates the reset): it is reported not stored and its staging returned."""
    w = make_worker(staging_chunks=4)
    save = ChunkSave("chunk-held", None, [0, 1], save_id=7, hold=True)
    meta = TieredConnectorMetadata(requests=[RequestPlan("r", saves=[save])], step=1)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.save_kv_layer(meta, layer)
    w.wait_for_save(meta)
    old_key = object_key(w.digest, "chunk-held")
    w.digest = "test-digest-epoch-1"  # what set_epoch does at a cache reset
    w.start_load_kv(TieredConnectorMetadata(step=2, commit_saves=[7]))
    assert w.flush(10)
    assert _reports_until(w, 1) == {7: False}
    assert w.client.lookup([old_key]) == 0
    assert w.staging is not None and w.staging.in_use_bytes == 0
