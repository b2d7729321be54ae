"""Loads beside the steps (:mod:`vllm_plugin.worker_async_loads`) on a real
:class:`vllm_plugin.worker.WorkerSide` with a real store and real paged CPU tensors (the
``make_worker`` fixture of ``test_worker_steps.py``), driven as vLLM's model runner drives a step:
``start_load_kv`` .. ``wait_for_save``, then ``get_finished`` (``take_finished_loads``) before
``get_block_ids_with_load_errors`` (``take_load_errors``).

Fault injection only where the fault is the point: a page layer whose copy waits for a gate (a slow
copy), a store whose lease of one key waits for a gate (a slow read) or answers NOT_FOUND (a chunk
gone since the lookup), a store without the slot API (the staged path).
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
from store_backend.slots import SlotLease  # noqa: E402
from store_backend.types import Status  # noqa: E402
from tests.vllm_plugin.test_worker_layers import _blocks, _NoSlots, _save, _slots_held, _worker  # noqa: E402
from tests.vllm_plugin.test_worker_steps import LAYERS, make_worker  # noqa: E402, F401
from vllm_plugin.metadata import ChunkLoad, RequestPlan, TieredConnectorMetadata  # noqa: E402
from vllm_plugin.worker import WorkerSide  # noqa: E402


class _Leases:
    """Fault injection on ``lease``: a lease of ``gated`` waits for ``gate`` (a slow read, e.g. a
    save still in flight), and ``missing`` answers NOT_FOUND (a chunk evicted since the scheduler's
    lookup); every other call goes to the real store."""

    def __init__(self, inner: Any, *, missing: str | None = None, gated: str | None = None) -> None:
        self.inner = inner
        self.missing = missing
        self.gated = gated
        self.gate = threading.Event()

    def lease(self, keys: Sequence[str], **kwargs: Any) -> list[Any]:
        if self.gated in keys:
            assert self.gate.wait(30), "gate never opened"
        leases = self.inner.lease(keys, **kwargs)
        for i, k in enumerate(keys):
            if k == self.missing:
                if leases[i].status is Status.OK:
                    self.inner.release([leases[i]])
                leases[i] = SlotLease(Status.NOT_FOUND, k)
        return leases

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _patient(w: WorkerSide) -> WorkerSide:
    """``w`` with 10 s for each load (the fixture's 0.5 s is for the timeout's own test): a test
    whose job waits on a gate must not see it run out of time on a busy machine."""
    w.cfg = msgspec.structs.replace(w.cfg, load_timeout_s=10.0)
    return w


def _faulty(w: WorkerSide, **faults: Any) -> _Leases:
    store = _Leases(w.store, **faults)
    w.client.close()
    w.client = KVClient(store, io_workers=2).start()
    return store


def _async_meta(step: int, *plans: tuple[str, list[tuple[str, list[int]]]]) -> TieredConnectorMetadata:
    return TieredConnectorMetadata(step=step, requests=[
        RequestPlan(req_id, loads=[ChunkLoad(h, blocks) for h, blocks in loads], async_load=True)
        for req_id, loads in plans])


def _run_step(w: WorkerSide, meta: TieredConnectorMetadata) -> tuple[set[str], set[int]]:
    """One step as vLLM's model runner drives it (no sync loads: start_load_kv after the forward);
    returns what get_finished and get_block_ids_with_load_errors answered, in that order."""
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
        w.save_kv_layer(meta, layer)
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    finished = w.take_finished_loads()
    errors = w.take_load_errors()
    w.build_worker_meta()
    return finished, errors


def _steps_until(w: WorkerSide, req_id: str, first_step: int, timeout_s: float = 10.0) -> tuple[int, set[int]]:
    """Empty steps (vLLM keeps stepping while a request is parked) until ``req_id`` is named;
    returns the step that named it and every load error reported up to then."""
    errors: set[int] = set()
    deadline = time.monotonic() + timeout_s
    step = first_step
    while time.monotonic() < deadline:
        finished, errs = _run_step(w, TieredConnectorMetadata(step=step))
        errors |= errs
        if req_id in finished:
            return step, errors
        step += 1
        time.sleep(0.005)  # an engine's step; the loop has a deadline
    raise AssertionError(f"{req_id} never named as loaded; stats {w.stats()}")


def test_an_async_load_lands_byte_equal_and_the_request_is_named_once(make_worker: Any) -> None:
    """Two chunks load beside the steps into blocks 20-23: the request is named once (never again
    in later steps), the bytes equal the saved ones, every lease is given back, and the step
    loader was never used."""
    w = make_worker(staging_chunks=8)
    want = _blocks(w, [0, 1, 2, 3])
    _save(w, "a0", [0, 1], step=1)
    _save(w, "a1", [2, 3], step=2)
    named, errors = _run_step(w, _async_meta(3, ("r", [("a0", [20, 21]), ("a1", [22, 23])])))
    step = 3
    if "r" not in named:
        step, more = _steps_until(w, "r", 4)
        errors |= more
    for later in range(step + 1, step + 4):
        again, errs = _run_step(w, TieredConnectorMetadata(step=later))
        assert "r" not in again and not errs
    assert errors == set()
    for got, exp in zip(_blocks(w, [20, 21, 22, 23]), want):
        assert torch.equal(got, exp)
    assert _slots_held(w) == 0
    st = w.stats()
    assert st["chunks_loaded"] == 2 and st["async_load_jobs"] == 1 and st["async_loads_in_flight"] == 0
    assert w.loader is None  # the step loader never started: nothing of it was a step's load


def test_a_slow_async_load_holds_up_no_step_and_a_step_load_passes_it(make_worker: Any) -> None:
    """The async copy is stuck inside layer 0: the steps go on, and a later step's own (layer-wise)
    load of another chunk completes meanwhile, on the step loader; once the copy goes on, the
    request is named with no error."""
    w = _patient(_worker(make_worker, copy="background", gated=True))
    want = _blocks(w, [0, 1, 2, 3])
    _save(w, "s0", [0, 1], step=1)
    _save(w, "s1", [2, 3], step=2)
    w.paged[0].gate.clear()
    named, errors = _run_step(w, _async_meta(3, ("slow", [("s0", [24, 25])])))
    assert w.paged[0].entered.wait(5)
    assert named == set() and errors == set()
    # The next step loads s1 into blocks 26-27 in its forward: it must not queue behind "slow".
    w.paged[0].entered.clear()
    meta = TieredConnectorMetadata(step=4, requests=[RequestPlan("fast", loads=[ChunkLoad("s1", [26, 27])])])
    w.start_load_kv(meta)
    assert w.paged[0].entered.wait(5)
    w.paged[0].gate.set()  # both copies go on now; the step's load must not have waited for "slow"
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    _steps_until(w, "slow", 5)
    for got, exp in zip(_blocks(w, [24, 25]), [t[:2] for t in want]):
        assert torch.equal(got, exp)
    for got, exp in zip(_blocks(w, [26, 27]), [t[2:] for t in want]):
        assert torch.equal(got, exp)
    assert _slots_held(w) == 0


def test_a_chunk_gone_since_the_lookup_is_an_error_no_later_than_the_request_is_named(make_worker: Any) -> None:
    """The second chunk's lease finds nothing: its blocks are in the load errors of a step no later
    than the one naming the request (vLLM recomputes from there); the first chunk's bytes land."""
    w = make_worker(staging_chunks=8)
    want = _blocks(w, [0, 1])
    _save(w, "g0", [0, 1], step=1)
    _save(w, "g1", [2, 3], step=2)
    _faulty(w, missing=object_key(w.digest, "g1"))
    named, errors = _run_step(w, _async_meta(3, ("g", [("g0", [4, 5]), ("g1", [6, 7])])))
    if "g" not in named:
        _step, more = _steps_until(w, "g", 4)
        errors |= more
    assert errors == {6, 7}
    for got, exp in zip(_blocks(w, [4, 5]), want):
        assert torch.equal(got, exp)
    assert w.stats()["chunks_load_failed"] == 1
    assert _slots_held(w) == 0


def test_a_slow_resolve_holds_up_no_later_job(make_worker: Any) -> None:
    """Job A's lease waits (a save still in flight); job B, one step later, resolves at once and is
    written and named while A still waits; A lands once its lease is answered."""
    w = _patient(make_worker(staging_chunks=8))  # A must not run out of time here
    want = _blocks(w, [0, 1, 2, 3])
    _save(w, "h0", [0, 1], step=1)
    _save(w, "h1", [2, 3], step=2)
    store = _faulty(w, gated=object_key(w.digest, "h0"))
    _run_step(w, _async_meta(3, ("A", [("h0", [8, 9])])))
    named, errors = _run_step(w, _async_meta(4, ("B", [("h1", [10, 11])])))
    if "B" not in named:
        _step, errors = _steps_until(w, "B", 5)
    assert errors == set()
    assert w.stats()["async_loads_in_flight"] == 1  # A, still resolving
    store.gate.set()
    _step, errors = _steps_until(w, "A", 20)
    assert errors == set()
    for got, exp in zip(_blocks(w, [8, 9, 10, 11]), want):
        assert torch.equal(got, exp)
    assert _slots_held(w) == 0


def test_a_job_past_the_loader_bound_is_named_at_once_with_its_blocks_failed(make_worker: Any,
                                                                              monkeypatch: Any) -> None:
    """More jobs resolving than the loader takes (one here): the next one is refused and its
    request named in the same step, every block in the errors, long before load_timeout_s."""
    monkeypatch.setattr("vllm_plugin.worker_async_loads.MAX_ASYNC_JOBS", 1)
    w = _patient(make_worker(staging_chunks=8))
    _save(w, "o0", [0, 1], step=1)
    _save(w, "o1", [2, 3], step=2)
    store = _faulty(w, gated=object_key(w.digest, "o0"))
    _run_step(w, _async_meta(3, ("first", [("o0", [12, 13])])))
    named, errors = _run_step(w, _async_meta(4, ("second", [("o1", [14, 15])])))
    assert named == {"second"} and errors == {14, 15}
    store.gate.set()
    _step, errors = _steps_until(w, "first", 5)
    assert errors == set() and _slots_held(w) == 0


def test_the_staged_path_loads_byte_equal_and_fails_at_once_without_staging(make_worker: Any) -> None:
    """A store without the slot API: the chunk is read into staging by the I/O threads and lands
    byte-equal, its buffer returned. With no staging buffer free the chunk fails before any read
    (the forward thread never waits for one) and the request is named in that same step."""
    w = make_worker(staging_chunks=8)
    want = _blocks(w, [0, 1])
    _save(w, "st0", [0, 1], step=1)
    w.client.close()
    w.client = KVClient(_NoSlots(w.store), io_workers=2).start()
    assert not w.loads.one_copy
    named, errors = _run_step(w, _async_meta(2, ("s", [("st0", [16, 17])])))
    if "s" not in named:
        _step, errors = _steps_until(w, "s", 3)
    assert errors == set()
    for got, exp in zip(_blocks(w, [16, 17]), want):
        assert torch.equal(got, exp)
    assert w.staging is not None and w.staging.in_use_bytes == 0
    taken = [w.staging.try_acquire(w.layout.chunk_bytes) for _ in range(8)]
    t0 = time.monotonic()
    named, errors = _run_step(w, _async_meta(9, ("none", [("st0", [18, 19])])))
    assert time.monotonic() - t0 < w.cfg.load_timeout_s
    assert named == {"none"} and errors == {18, 19}
    for buf in taken:
        w.staging.release(buf)


def test_an_async_load_past_the_load_timeout_fails_whole_and_writes_nothing_after(make_worker: Any) -> None:
    """The copy is stuck past load_timeout_s (0.5 s here): the request is named with every block in
    the errors, and once named no layer is written into its blocks (vLLM recomputes them)."""
    w = _worker(make_worker, gated=True)
    _save(w, "t0", [0, 1], step=1)
    w.paged[0].gate.clear()
    _run_step(w, _async_meta(2, ("late", [("t0", [8, 9])])))
    assert w.paged[0].entered.wait(5)
    before = w.paged[1].kv[[8, 9]].clone()
    t0 = time.monotonic()
    opener = threading.Timer(w.cfg.load_timeout_s + 0.3, w.paged[0].gate.set)
    opener.start()
    try:
        step, errors = _steps_until(w, "late", 3)
        assert time.monotonic() - t0 >= w.cfg.load_timeout_s - 0.05
    finally:
        opener.join()
    assert errors == {8, 9}
    assert w.stats()["async_load_timeouts"] == 1
    assert _slots_held(w) == 0
    # Joining the loader's thread: any layer it would still write is written by then.
    assert w.async_loads.close(timeout_s=5) == 0
    assert w.paged[1].writes == [] and torch.equal(w.paged[1].kv[[8, 9]], before)


def test_closing_with_async_loads_in_flight_gives_their_leases_back(make_worker: Any) -> None:
    """Shutdown while a copy is inside layer 0: close waits for that layer, starts no other, and
    every lease goes back."""
    w = _patient(_worker(make_worker, gated=True))
    _save(w, "c0", [0, 1], step=1)
    w.paged[0].gate.clear()
    _run_step(w, _async_meta(2, ("c", [("c0", [10, 11])])))
    assert w.paged[0].entered.wait(5)
    threading.Timer(0.2, w.paged[0].gate.set).start()
    assert w.async_loads.close(timeout_s=5) == 0
    assert w.paged[1].writes == []
    assert _slots_held(w) == 0
