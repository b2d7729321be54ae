"""Layer-wise loads and one-copy saves/loads of the worker half, driven as vLLM drives a step, on a
real :class:`vllm_plugin.worker.WorkerSide` with a real store and real paged CPU tensors (the
``make_worker`` fixture of ``test_worker_steps.py``).

Fault injection only where a fault is the point: a page layer whose copy is gated (a slow copy), a
store whose ``release`` says the bytes were not stable (an expired lease), a store without the slot
API (the staging fallback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

import msgspec  # noqa: E402
import torch  # noqa: E402

from mooncake_connector.client import KVClient  # noqa: E402
from mooncake_connector.keys import object_key  # noqa: E402
from mooncake_connector.layout import PageFormat, PagedLayer  # noqa: E402
from mooncake_connector.staging import StagingPool  # noqa: E402
from tests.store_backend.node.server_harness import wait_until  # noqa: E402
from tests.vllm_plugin.test_worker_steps import BLOCK, LAYERS, NUM_BLOCKS, make_worker  # noqa: E402, F401
from vllm_plugin.metadata import ChunkLoad, ChunkSave, RequestPlan, TieredConnectorMetadata  # noqa: E402
from vllm_plugin.worker import WorkerSide  # noqa: E402


class _GatedLayer(PagedLayer):
    """A page layer whose loads wait for ``gate`` (a slow copy), recording when each write ended."""

    def __init__(self, kv: torch.Tensor) -> None:
        super().__init__(kv, PageFormat.KV_HALVES, num_heads=2, head_size=64)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.writes: list[float] = []

    def scatter_from(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        assert self.gate.wait(30), "gate never opened"
        super().scatter_from(*args, **kwargs)
        self.writes.append(time.monotonic())


class _CountingStaging(StagingPool):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.acquired = 0

    def acquire(self, nbytes: int, timeout_s: float) -> torch.Tensor | None:
        self.acquired += 1
        return super().acquire(nbytes, timeout_s)


class _NoSlots:
    """A store without the slot API (the methods are hidden): the worker must go through staging."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("reserve", "commit", "abort", "lease", "release"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _UnstableReleases:
    """Fault injection: ``release`` answers False (the leases expired while the bytes were read)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.released = 0

    def release(self, leases: Sequence[Any]) -> list[bool]:
        self.inner.release(leases)
        self.released += len(leases)
        return [False] * len(leases)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _worker(make_worker: Any, *, copy: str = "inline", gated: bool = False, store: Any = None) -> WorkerSide:
    w = make_worker(staging_chunks=8)
    w.staging = _CountingStaging(8 * w.layout.chunk_bytes)
    w.cfg = msgspec.structs.replace(w.cfg, load_copy=copy)
    if gated:
        w.paged = [_GatedLayer(torch.randn(NUM_BLOCKS, 2, BLOCK, 128)) for _ in LAYERS]
    if store is not None:
        w.client.close()
        w.client = KVClient(store, io_workers=2).start()
    return w


def _save(w: WorkerSide, chunk_hash: str, blocks: list[int], step: int) -> None:
    """One step saving blocks ``blocks`` as chunk ``chunk_hash``, every hook run; waits until stored."""
    meta = TieredConnectorMetadata(requests=[RequestPlan(f"s{step}", saves=[ChunkSave(chunk_hash, None, blocks,
                                                                                      save_id=step)])], step=step)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
        w.save_kv_layer(meta, layer)
    w.wait_for_save(meta)
    assert w.flush(10)
    reports = {r.save_id: r.ok for r in w.build_worker_meta().saves}
    deadline = time.monotonic() + 10
    while step not in reports and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval; the loop has a deadline
        reports.update({r.save_id: r.ok for r in w.build_worker_meta().saves})
    assert reports.get(step) is True


def _load_meta(chunk_hash: str, blocks: list[int], step: int) -> TieredConnectorMetadata:
    return TieredConnectorMetadata(requests=[RequestPlan(f"l{step}", loads=[ChunkLoad(chunk_hash, blocks)])],
                                   step=step)


def _blocks(w: WorkerSide, blocks: list[int]) -> list[torch.Tensor]:
    return [p.kv[blocks].clone() for p in w.paged]


def _slots_held(w: WorkerSide) -> int:
    return w.store.stats().slots.held_bytes


def _leases_and_releases(w: WorkerSide) -> tuple[int, int]:
    st = w.store.stats().store
    return st.slot_leases, st.slot_releases


@pytest.mark.parametrize("copy", ["inline", "background"])
def test_a_saved_chunk_loads_back_byte_equal_with_no_staging_on_the_slot_path(make_worker: Any, copy: str) -> None:
    """Save blocks 0-1 as a chunk and load it into blocks 4-5: the bytes equal, every slot is given
    back, and no staging buffer was acquired either way (one copy from the pages into the reserved
    slot, one from the leased slot into the pages)."""
    w = _worker(make_worker, copy=copy)
    want = _blocks(w, [0, 1])
    _save(w, f"rt-{copy}", [0, 1], step=1)
    meta = _load_meta(f"rt-{copy}", [4, 5], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    for got, exp in zip(_blocks(w, [4, 5]), want):
        assert torch.equal(got, exp)
    assert w.staging.acquired == 0
    assert _slots_held(w) == 0
    assert w.stats()["chunks_loaded"] == 1


def test_a_store_without_slots_saves_and_loads_through_staging(make_worker: Any) -> None:
    """The fallback: the same round trip through staging buffers (acquired, and all returned)."""
    w = make_worker(staging_chunks=8)
    w.client.close()
    w.client = KVClient(_NoSlots(w.store), io_workers=2).start()
    w.staging = _CountingStaging(8 * w.layout.chunk_bytes)
    want = _blocks(w, [2, 3])
    _save(w, "rt-staging", [2, 3], step=1)
    meta = _load_meta("rt-staging", [6, 7], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    for got, exp in zip(_blocks(w, [6, 7]), want):
        assert torch.equal(got, exp)
    assert w.staging.acquired == 2  # one for the save, one for the load
    deadline = time.monotonic() + 5
    while w.staging.in_use_bytes and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval; the loop has a deadline
    assert w.staging.in_use_bytes == 0


def test_layer_0_is_usable_while_layer_1_is_still_loading(make_worker: Any) -> None:
    """Background copies: wait_for_layer_load(layer 0) returns while the copy of layer 1 is held
    up, and layer 1 is then written by the loader without the forward asking for it (the forward
    of layer 0 overlaps the load of layer 1)."""
    w = _worker(make_worker, copy="background", gated=True)
    want = _blocks(w, [0, 1])
    _save(w, "gated", [0, 1], step=1)
    w.paged[1].gate.clear()
    meta = _load_meta("gated", [8, 9], step=2)
    w.start_load_kv(meta)
    t0 = time.monotonic()
    w.wait_for_layer_load(meta, LAYERS[0])
    assert time.monotonic() - t0 < w.cfg.load_timeout_s  # not a timeout in disguise
    job = w.load_job
    assert job is not None
    assert w.paged[1].entered.wait(5)  # the loader is inside layer 1's copy
    assert job.layer_ready[0].is_set() and not job.layer_ready[1].is_set()
    assert torch.equal(w.paged[0].kv[[8, 9]], want[0])
    w.paged[1].gate.set()
    assert job.layer_ready[1].wait(5)  # written ahead of the forward's call for it
    w.wait_for_layer_load(meta, LAYERS[1])
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    assert torch.equal(w.paged[1].kv[[8, 9]], want[1])
    assert job.time_to_first_layer_s() is not None and job.time_to_first_layer_s() < job.load_s()


def test_a_late_step_cancels_and_never_writes_a_layer_after_it_ended(make_worker: Any) -> None:
    """vLLM never ran this step's hooks (nor wait_for_save): the next step ends it while the loader
    is inside layer 0's copy. Ending it waits for that copy, writes no further layer (layer 1's
    blocks keep their bytes, even later), and reports the chunk as a failed load."""
    w = _worker(make_worker, copy="background", gated=True)
    _save(w, "late", [0, 1], step=1)
    w.paged[0].gate.clear()
    meta = _load_meta("late", [10, 11], step=2)
    w.start_load_kv(meta)
    assert w.paged[0].entered.wait(5)
    before = w.paged[1].kv[[10, 11]].clone()
    threading.Timer(0.3, w.paged[0].gate.set).start()
    w.start_load_kv(TieredConnectorMetadata(step=3))  # the next step: ends step 2 late
    ended = time.monotonic()
    assert len(w.paged[0].writes) == 1 and w.paged[0].writes[0] <= ended  # the copy in flight finished
    time.sleep(0.3)  # the window in which no further layer may be written
    assert w.paged[1].writes == []  # no layer started after the step ended
    assert torch.equal(w.paged[1].kv[[10, 11]], before)
    assert w.take_load_errors() == {10, 11}
    assert _slots_held(w) == 0


def test_a_late_step_of_inline_copies_reports_its_unwritten_layers(make_worker: Any) -> None:
    """Inline copies: only layer 0's hook ran before the step was left; layer 1 is never written
    and the chunk is a failed load."""
    w = _worker(make_worker, copy="inline", gated=True)
    _save(w, "late-inline", [0, 1], step=1)
    meta = _load_meta("late-inline", [12, 13], step=2)
    w.start_load_kv(meta)
    w.wait_for_layer_load(meta, LAYERS[0])
    w.start_load_kv(TieredConnectorMetadata(step=3))
    assert len(w.paged[0].writes) == 1 and w.paged[1].writes == []
    assert w.take_load_errors() == {12, 13}
    assert _slots_held(w) == 0


def test_a_lease_whose_bytes_were_not_stable_is_a_load_error(make_worker: Any) -> None:
    """release answers False (the lease expired while the layers were copied): the chunk's blocks
    are reported as load errors, so vLLM recomputes them instead of using those bytes."""
    w = make_worker(staging_chunks=8)
    _save(w, "unstable", [0, 1], step=1)
    faulty = _UnstableReleases(w.store)
    w.client.close()
    w.client = KVClient(faulty, io_workers=2).start()
    meta = _load_meta("unstable", [14, 15], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert faulty.released == 1
    assert w.take_load_errors() == {14, 15}
    assert w.stats()["chunks_loaded"] == 0


def test_a_chunk_the_store_holds_already_is_reported_saved_without_a_gather(make_worker: Any) -> None:
    """reserve answers EXISTS for a stored key: the save is reported stored and nothing is gathered
    (the pages are not even read: they hold other bytes now, the stored object keeps its own)."""
    w = _worker(make_worker)
    want = _blocks(w, [0, 1])
    _save(w, "twice", [0, 1], step=1)
    for p in w.paged:
        p.kv[[2, 3]] = torch.randn_like(p.kv[[2, 3]])
    _save(w, "twice", [2, 3], step=2)  # reported True: asserted inside
    assert w.stats()["saves_exists"] == 1
    meta = _load_meta("twice", [16, 17], step=3)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    for got, exp in zip(_blocks(w, [16, 17]), want):
        assert torch.equal(got, exp)


def test_a_held_save_keeps_its_slot_until_the_scheduler_decides(make_worker: Any) -> None:
    """A held save stays reserved (invisible) across steps; committed later, it is stored; a
    discarded one gives its slot back."""
    w = _worker(make_worker)
    saves = [ChunkSave("held-keep", None, [0, 1], save_id=21, hold=True),
             ChunkSave("held-drop", None, [2, 3], save_id=22, hold=True)]
    meta = TieredConnectorMetadata(requests=[RequestPlan("r", saves=saves)], step=1)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.save_kv_layer(meta, layer)
    w.wait_for_save(meta)
    keep, drop = object_key(w.digest, "held-keep"), object_key(w.digest, "held-drop")
    assert w.store.contains([keep, drop]) == [False, False]
    assert _slots_held(w) == 2 * w.layout.chunk_bytes
    w.start_load_kv(TieredConnectorMetadata(step=2, commit_saves=[21], discard_saves=[22]))
    assert w.flush(10)
    deadline = time.monotonic() + 5
    while not w.store.contains([keep])[0] and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval; the loop has a deadline
    assert w.store.contains([keep, drop]) == [True, False]
    assert _slots_held(w) == 0


class _SlowLeases:
    """Fault injection: ``lease`` hangs until ``gate`` is set (a store stuck in a stage-in)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def lease(self, *args: Any, **kwargs: Any) -> list[Any]:
        assert self.gate.wait(30)
        return self.inner.lease(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("copy", ["inline", "background"])
def test_a_lease_answering_after_the_load_timeout_is_never_used(make_worker: Any, copy: str) -> None:
    """The leases come only after load_timeout_s: the forward gets the blocks as load errors within
    about that time, the leases that arrive later are not used (no layer written, nothing counted
    loaded) and are given back."""
    w = _worker(make_worker, copy=copy, gated=True)
    _save(w, f"slow-{copy}", [0, 1], step=1)
    slow = _SlowLeases(w.store)
    w.client.close()
    w.client = KVClient(slow, io_workers=2).start()
    meta = _load_meta(f"slow-{copy}", [18, 19], step=2)
    t0 = time.monotonic()
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert time.monotonic() - t0 < 3 * w.cfg.load_timeout_s + 1
    assert w.take_load_errors() == {18, 19}
    leases, releases = _leases_and_releases(w)
    slow.gate.set()
    wait_until(lambda: (now := _leases_and_releases(w))[0] > leases and now[1] - releases >= now[0] - leases,
               10, "the late leases taken and given back")
    time.sleep(0.1)  # the window in which a late lease's layer write would land
    assert [p.writes for p in w.paged] == [[], []]
    assert _slots_held(w) == 0
    assert w.stats()["chunks_loaded"] == 0


def test_a_round_trip_through_a_node_service_copies_straight_into_its_segment(make_worker: Any) -> None:
    """The same one-copy round trip with the worker attached to a node service (its client maps the
    service's shared segment): saved from blocks 0-1, loaded into blocks 20-21 byte-equal, no
    staging acquired, and the service holds no slot afterwards."""
    from tests.store_backend.conftest import serve_node

    node = serve_node({"dram": {"capacity_bytes": 64 * 1024 * 1024}})
    w = make_worker(staging_chunks=8)
    try:
        w = _worker(lambda **_: w, copy="background", store=node)
        want = _blocks(w, [0, 1])
        _save(w, "via-node", [0, 1], step=1)
        assert node.contains([object_key(w.digest, "via-node")]) == [True]
        meta = _load_meta("via-node", [20, 21], step=2)
        w.start_load_kv(meta)
        for layer in LAYERS:
            w.wait_for_layer_load(meta, layer)
        w.wait_for_save(meta)
        assert w.take_load_errors() == set()
        for got, exp in zip(_blocks(w, [20, 21]), want):
            assert torch.equal(got, exp)
        assert w.staging.acquired == 0
        assert node.stats().slots.held_bytes == 0
    finally:
        w.client.close()
        node.close(flush=False, timeout_s=10)


def test_a_forward_slower_than_the_timeouts_keeps_its_loads_and_saves(make_worker: Any) -> None:
    """A step's forward may take longer than load_timeout_s and lease_ttl_s on a loaded machine
    (a long prefill): that alone must not fail its loads (the leases are held across the forward)
    nor its saves (reserved at the first save hook, committed after the forward)."""
    w = _worker(make_worker)
    w.cfg = msgspec.structs.replace(w.cfg, lease_ttl_s=0.5)
    slow_s = 4 * w.cfg.load_timeout_s
    want = _blocks(w, [0, 1])
    save = ChunkSave("slow-forward", None, [0, 1], save_id=31)
    meta = TieredConnectorMetadata(requests=[RequestPlan("s", saves=[save])], step=1)
    w.start_load_kv(meta)
    w.save_kv_layer(meta, LAYERS[0])
    time.sleep(slow_s)  # the slow forward under test
    w.save_kv_layer(meta, LAYERS[1])
    w.wait_for_save(meta)
    assert w.flush(10)
    deadline = time.monotonic() + 5
    reports: dict[int, bool] = {}
    while 31 not in reports and time.monotonic() < deadline:
        reports.update({r.save_id: r.ok for r in w.build_worker_meta().saves})
        time.sleep(0.01)  # poll interval; the loop has a deadline
    assert reports == {31: True}
    meta = _load_meta("slow-forward", [22, 23], step=2)
    w.start_load_kv(meta)
    w.wait_for_layer_load(meta, LAYERS[0])
    time.sleep(slow_s)  # the slow forward under test
    w.wait_for_layer_load(meta, LAYERS[1])
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    for got, exp in zip(_blocks(w, [22, 23]), want):
        assert torch.equal(got, exp)
