"""The store's background workers under faults: a stuck worker bounds close() and is reported, an
exception that escapes a worker is logged and counted, and a dead worker loop never hangs a flush.

Faults are injected around real components: a real SSD backend wrapped so that its writes block or
its lookups raise, and a real :class:`BatchWorker` whose own bookkeeping raises."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from store_backend.config import load_config
from store_backend.engine import BatchWorker
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

MiB = 1 << 20
OBJ = 64 * 1024


def _config(tmp_path, **offload):  # noqa: ANN001, ANN202
    return load_config({"dram": {"capacity_bytes": 8 * MiB},
                        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "bucket",
                                "bucket_size_bytes": 1 * MiB, "admission_policy": "all"},
                        "offload": {"policy": "eager", **offload}})


class BlockingPuts:
    """A real backend whose writes wait until ``release`` is set (a hung disk)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name
        self.entered, self.release = threading.Event(), threading.Event()
        self.outcome: list[object] = []  # what the held write finally got: statuses or the exception

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        self.entered.set()
        self.release.wait(30)
        try:
            st = self.inner.put(keys, buffers)
        except Exception as e:  # noqa: BLE001
            self.outcome.append(e)
            raise
        self.outcome.append(st)
        return st

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


class RaisingSizeOf:
    """A real backend whose ``size_of`` raises (a promotion's first step)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name

    def size_of(self, keys):  # noqa: ANN001, ANN201
        raise RuntimeError("injected size_of failure")

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_close_with_a_stuck_offload_is_bounded_by_one_timeout_and_reports_the_thread(tmp_path, caplog) -> None:
    cfg = _config(tmp_path)
    assert cfg.ssd is not None
    ssd = BlockingPuts(open_ssd_backend(cfg.ssd))
    store = TieredStore(cfg, ssd=ssd).start()
    try:
        assert store.put(["k"], [payload("k", OBJ)]) == [Status.OK]
        assert ssd.entered.wait(10), "the offload never began"
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        store.close(timeout_s=1.0)
        elapsed = time.monotonic() - t0
        assert elapsed < 1.5, f"close(timeout_s=1) took {elapsed:.2f} s"
        assert store.metrics_counters.store.thread_join_timeouts == 1
        stuck = [r for r in caplog.records if r.levelno == logging.WARNING and "kv-offload" in r.getMessage()]
        assert stuck, [r.getMessage() for r in caplog.records]
    finally:
        ssd.release.set()
    # The tier was not closed under the write that was still running: it finishes normally.
    deadline = time.monotonic() + 10
    while not ssd.outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ssd.outcome and ssd.outcome[0] == [Status.OK], ssd.outcome
    for t in threading.enumerate():  # the left-behind worker ends by itself once its write returns
        if t.name == "kv-offload":
            t.join(10)
    ssd.inner.close()


def test_an_exception_escaping_a_worker_is_logged_and_counted_and_the_store_keeps_answering(tmp_path,
                                                                                            caplog) -> None:
    cfg = _config(tmp_path)
    with TieredStore(cfg) as first:
        assert first.put(["k"], [payload("k", OBJ)]) == [Status.OK]
        assert first.flush()
    assert cfg.ssd is not None
    caplog.set_level(logging.ERROR)
    with TieredStore(cfg, ssd=RaisingSizeOf(open_ssd_backend(cfg.ssd))) as store:
        buf = np.empty(OBJ, dtype=np.uint8)
        for _ in range(2):  # promotion.admission_hits = 2: the second SSD hit queues a promotion
            assert store.get_into(["k"], [buf])[0].status is Status.OK
        assert store._promoter.wait_idle(10)
        assert store.metrics_counters.store.worker_errors == 1
        logged = [r for r in caplog.records if "kv-promote" in r.getMessage()]
        assert logged and logged[0].exc_info is not None, "no traceback logged"
        assert store.get_into(["k"], [buf])[0].status is Status.OK
        np.testing.assert_array_equal(buf, payload("k", OBJ))


def test_a_dead_offload_loop_never_hangs_flush_and_is_counted(tmp_path, caplog) -> None:
    store = TieredStore(_config(tmp_path)).start()

    def broken_weight(key: str) -> int:
        raise RuntimeError("injected bookkeeping failure")

    store._offloader._weight = broken_weight  # the loop's own step, outside any handler
    caplog.set_level(logging.ERROR)
    try:
        assert store.put(["a"], [payload("a", OBJ)]) == [Status.OK]
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(store.flush()), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "flush hung on a dead offload worker"
        assert result == [True]  # the flush wrote it from the calling thread
        assert store._offloader.dead
        assert store.metrics_counters.store.worker_errors == 1
        assert any(r.exc_info is not None and "kv-offload" in r.getMessage() for r in caplog.records)
        assert store.put(["b"], [payload("b", OBJ)]) == [Status.OK]
        assert store.flush_report(timeout_s=10).ok
    finally:
        t0 = time.monotonic()
        store.close(timeout_s=5)
        assert time.monotonic() - t0 < 5


def test_batch_worker_close_shares_one_deadline_between_drain_and_join() -> None:
    gate = threading.Event()
    w: BatchWorker[int] = BatchWorker("test-stuck", lambda batch: gate.wait(30), queue_max=8)
    w.start()
    try:
        w.submit([1, 2])  # the first batch blocks; the rest waits behind it
        t0 = time.monotonic()
        assert w.close(drain=True, timeout_s=0.5) is False
        elapsed = time.monotonic() - t0
        assert elapsed < 0.9, f"close(timeout_s=0.5) took {elapsed:.2f} s"
    finally:
        gate.set()
