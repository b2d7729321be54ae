"""The forward thread never waits on the store past ``load_timeout_s``, never on a reservation of its
own, and a failed copy or a shutdown leaves no slot held and no exception in the forward."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mooncake_connector.keys import object_key
from store_backend.types import Status
from tests.store_backend.node.server_harness import wait_until
from tests.vllm_plugin.conftest import tiny_model  # noqa: F401  (fixture)
from tests.vllm_plugin.test_worker_layers import _load_meta, _save, _slots_held, _worker
from tests.vllm_plugin.test_worker_steps import LAYERS, make_worker  # noqa: F401  (fixture)
from vllm_plugin.metadata import ChunkLoad, ChunkSave, RequestPlan, TieredConnectorMetadata


class _Slow:
    """Fault injection: the named store calls sleep ``delay_s`` first."""

    def __init__(self, inner: Any, slow: set[str], delay_s: float) -> None:
        self.inner, self.slow, self.delay_s = inner, slow, delay_s
        self.returned = 0  # slowed calls that have returned

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.slow:
            return attr

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(self.delay_s)  # the simulated stall
            try:
                return attr(*a, **k)
            finally:
                self.returned += 1
        return slow


def test_a_stalled_reserve_blocks_the_save_hook_at_most_the_load_timeout(make_worker: Any) -> None:
    w = _worker(make_worker)
    inner = w.client.store
    w.client.store = slow = _Slow(inner, {"reserve"}, 3.0)
    meta = TieredConnectorMetadata(requests=[RequestPlan("s", saves=[ChunkSave("c-slow", None, [0, 1], save_id=1)])],
                                   step=1)
    w.start_load_kv(meta)
    t0 = time.monotonic()
    w.save_kv_layer(meta, LAYERS[0])
    took = time.monotonic() - t0
    for layer in LAYERS[1:]:
        w.save_kv_layer(meta, layer)
    w.wait_for_save(meta)
    assert took < w.cfg.load_timeout_s + 0.5
    reports = w.build_worker_meta().saves
    assert [(r.save_id, r.ok) for r in reports] == [(1, False)]  # not saved: planned again
    wait_until(lambda: slow.returned >= 1 and _slots_held(w) == 0, 30,
               "the late reservation came and was aborted")


def test_a_stalled_release_blocks_the_step_end_at_most_the_load_timeout(make_worker: Any) -> None:
    w = _worker(make_worker)
    _save(w, "c-rel", [0, 1], step=1)
    w.client.store = _Slow(w.client.store, {"release"}, 3.0)
    meta = _load_meta("c-rel", [4, 5], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    t0 = time.monotonic()
    w.wait_for_save(meta)
    took = time.monotonic() - t0
    assert took < w.cfg.load_timeout_s + 0.5
    assert w.take_load_errors() == {4, 5}  # not known stable in time: recomputed


class _FirstLeaseSlow:
    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s, self.calls = inner, delay_s, 0

    def lease(self, *a: Any, **k: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.delay_s)  # the simulated stuck lease
        return self.inner.lease(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("copy", ["inline", "background"])
def test_a_stuck_lease_does_not_fail_the_next_steps_unrelated_loads(make_worker: Any, copy: str) -> None:
    w = _worker(make_worker, copy=copy)
    _save(w, f"e-a-{copy}", [0, 1], step=1)
    _save(w, f"e-b-{copy}", [2, 3], step=2)
    w.client.store = _FirstLeaseSlow(w.client.store, 2.0)
    for step, (name, blocks) in enumerate([(f"e-a-{copy}", [4, 5]), (f"e-b-{copy}", [6, 7])], start=3):
        meta = _load_meta(name, blocks, step=step)
        w.start_load_kv(meta)
        for layer in LAYERS:
            w.wait_for_layer_load(meta, layer)
        w.wait_for_save(meta)
        errors = w.take_load_errors()
        assert errors == ({4, 5} if step == 3 else set())
    assert [b.tolist() for b in _load_blocks(w, [6, 7])] == [b.tolist() for b in _load_blocks(w, [2, 3])]


def _load_blocks(w: Any, blocks: list[int]) -> list[Any]:
    return [p.kv[b].clone() for p in w.paged for b in blocks]


class _BadView:
    """Fault injection: every OK lease's view is too short, so a layer's copy raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def lease(self, *a: Any, **k: Any) -> Any:
        out = self.inner.lease(*a, **k)
        for ls in out:
            if ls.status is Status.OK:
                ls.view = memoryview(bytearray(8))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("copy", ["inline", "background"])
def test_a_copy_that_raises_fails_the_chunk_not_the_forward(make_worker: Any, copy: str) -> None:
    w = _worker(make_worker, copy=copy)
    _save(w, f"f-{copy}", [0, 1], step=1)
    w.client.store = _BadView(w.client.store)
    meta = _load_meta(f"f-{copy}", [8, 9], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert w.take_load_errors() == {8, 9}


def test_close_gives_back_the_open_steps_leases_and_reservations(make_worker: Any, monkeypatch: Any) -> None:
    import vllm_plugin.worker as worker_mod

    w = _worker(make_worker, copy="background")
    deadline = time.monotonic() + 10
    while _slots_held(w) and time.monotonic() < deadline:
        time.sleep(0.05)  # earlier tests' stalled calls (on this module's shared store) end
    assert _slots_held(w) == 0
    _save(w, "g-load", [0, 1], step=1)
    store = w.store
    meta = TieredConnectorMetadata(requests=[RequestPlan("r", loads=[ChunkLoad("g-load", [4, 5])],
                                                         saves=[ChunkSave("g-save", "g-load", [6, 7], save_id=9)])],
                                   step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
        w.save_kv_layer(meta, layer)
    assert _slots_held(w) > 0
    # Another holder (the scheduler's connector in the same process) keeps the store open.
    release = worker_mod.release_store
    monkeypatch.setattr(worker_mod, "release_store", lambda *a, **k: None)
    w.close()
    try:
        assert store.stats().slots.held_bytes == 0
    finally:
        release(store, flush=False, flush_timeout_s=10)  # the reference the worker left


def test_a_load_of_this_workers_own_held_reservation_fails_at_once(make_worker: Any) -> None:
    from tests.store_backend.conftest import serve_node

    node = serve_node({"dram": {"capacity_bytes": 64 * 1024 * 1024}})
    w0 = make_worker(staging_chunks=8)
    try:
        w = _worker(lambda **_: w0, copy="background", store=node)
        save = ChunkSave("h-held", None, [0, 1], save_id=41, hold=True)
        meta = TieredConnectorMetadata(requests=[RequestPlan("a", saves=[save])], step=1)
        w.start_load_kv(meta)
        for layer in LAYERS:
            w.save_kv_layer(meta, layer)
        w.wait_for_save(meta)
        key = object_key(w.digest, "h-held")
        assert node.exists_all([[key]], count_reserved=True) == 1  # the scheduler plans a load of it
        meta = _load_meta("h-held", [4, 5], step=2)  # no decision on save 41 yet (async scheduling)
        t0 = time.monotonic()
        w.start_load_kv(meta)
        for layer in LAYERS:
            w.wait_for_layer_load(meta, layer)
        stalled = time.monotonic() - t0
        w.wait_for_save(meta)
        assert stalled < 0.5 * w.cfg.load_timeout_s
        assert w.take_load_errors() == {4, 5}
        # The decision still commits it, and it loads then.
        w.start_load_kv(TieredConnectorMetadata(step=3, commit_saves=[41]))
        assert w.flush(10)
        assert node.contains([key])[0]
    finally:
        w0.client.close()
        node.close(flush=False, timeout_s=10)
