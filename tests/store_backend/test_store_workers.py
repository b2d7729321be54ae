"""The store's background workers under faults: a stuck worker bounds close() and is reported, an
exception that escapes a worker is logged and counted, and a dead worker loop never hangs a flush.

Faults are injected around real components: a real SSD backend wrapped so that its writes block or
its lookups raise, and a real :class:`BatchWorker` whose own bookkeeping raises."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

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


class NonsenseSizeOf(RaisingSizeOf):
    """A real backend whose ``size_of`` answers something that is not a size: the promotion's
    bookkeeping then raises inside the worker (an exception no tier call was expected to raise)."""

    def size_of(self, keys):  # noqa: ANN001, ANN201
        return ["not a size"] * len(keys)


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
        # At least: under heavy load a worker slow to wake from stop() is counted too.
        assert store.metrics_counters.store.thread_join_timeouts >= 1
        stuck = [r for r in caplog.records if r.levelno == logging.WARNING and "kv-offload" in r.getMessage()]
        assert stuck, [r.getMessage() for r in caplog.records]
    finally:
        ssd.release.set()
    # The tier was not closed under the write that was still running: it finishes normally.
    deadline = time.monotonic() + 10
    while not ssd.outcome and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval; the loop has a deadline
    assert ssd.outcome and ssd.outcome[0] == [Status.OK], ssd.outcome
    _join_named("kv-offload")  # the left-behind worker ends by itself once its write returns
    # What the late write landed stays on SSD: the worker found the index close() left alive and
    # did not take the object for a removed one (it used to delete the copy it had just written).
    assert ssd.inner.contains(["k"]) == [True]
    # The last thread using the tier closed it and gave up the directory's lock: the directory
    # opens again in this process, and the object is there.
    with TieredStore(cfg) as again:
        buf = np.empty(OBJ, dtype=np.uint8)
        assert again.get_into(["k"], [buf])[0].status is Status.OK
        np.testing.assert_array_equal(buf, payload("k", OBJ))


def _join_named(name: str, timeout_s: float = 10) -> None:
    for t in threading.enumerate():
        if t.name == name:
            t.join(timeout_s)
            assert not t.is_alive(), f"{name} still running"


def _promoted_through(tmp_path, wrapper: type) -> tuple[TieredStore, np.ndarray]:  # noqa: ANN001
    """A started store over an SSD directory holding "k" only (its backend wrapped in ``wrapper``),
    after the second SSD hit of "k" queued its promotion and the promotion worker went idle."""
    cfg = _config(tmp_path)
    with TieredStore(cfg) as first:
        assert first.put(["k"], [payload("k", OBJ)]) == [Status.OK]
        assert first.flush()
    assert cfg.ssd is not None
    store = TieredStore(cfg, ssd=wrapper(open_ssd_backend(cfg.ssd))).start()
    buf = np.empty(OBJ, dtype=np.uint8)
    for _ in range(2):  # promotion.admission_hits = 2: the second SSD hit queues a promotion
        assert store.get_into(["k"], [buf])[0].status is Status.OK
    assert store.wait_idle(10, offload=False, events=False)
    return store, buf


def test_an_exception_escaping_a_worker_is_logged_and_counted_and_the_store_keeps_answering(tmp_path,
                                                                                            caplog) -> None:
    caplog.set_level(logging.ERROR)
    store, buf = _promoted_through(tmp_path, NonsenseSizeOf)
    with store:
        assert store.metrics_counters.store.worker_errors == 1
        logged = [r for r in caplog.records if "kv-promote" in r.getMessage()]
        assert logged and logged[0].exc_info is not None, "no traceback logged"
        assert store.get_into(["k"], [buf])[0].status is Status.OK
        np.testing.assert_array_equal(buf, payload("k", OBJ))


def test_a_promotion_from_a_tier_whose_size_of_raises_is_skipped_not_a_worker_error(tmp_path, caplog) -> None:
    """The fill primitive survives a tier whose ``size_of`` raises, for promotion as for a lease's
    stage-in: the promotion is skipped and counted, the tier's failure logged once with its
    traceback, and the worker has no error to count."""
    caplog.set_level(logging.ERROR)
    store, buf = _promoted_through(tmp_path, RaisingSizeOf)
    with store:
        m = store.metrics()["store"]
        assert m["worker_errors"] == 0 and m["promotions_skipped"] == 1
        logged = [r for r in caplog.records if "size_of raised" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None, [r.getMessage() for r in caplog.records]
        assert store.tier_of(["k"]) == ["ssd"]  # not promoted
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


class BlockingGets:
    """A real backend whose reads wait until ``release`` is set; records whether ``close`` was
    called while a read was still in flight."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name
        self.entered, self.release = threading.Event(), threading.Event()
        self.in_flight = 0
        self.closed_under_a_read = False
        self.closes = 0

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        self.in_flight += 1
        try:
            self.entered.set()
            self.release.wait(30)
            return self.inner.get_into(keys, buffers)
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        self.closes += 1
        self.closed_under_a_read |= self.in_flight > 0
        self.inner.close()

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def _persist(cfg, keys) -> None:  # noqa: ANN001
    with TieredStore(cfg) as s:
        for k in keys:
            assert s.put([k], [payload(k, OBJ)]) == [Status.OK]
        assert s.flush()


def _warned(caplog, *words: str) -> bool:  # noqa: ANN001
    return any(r.levelno == logging.WARNING and all(w in r.getMessage() for w in words) for r in caplog.records)


def test_close_leaves_the_ssd_tier_open_for_a_call_still_reading_and_the_call_closes_it(tmp_path, caplog) -> None:
    cfg = _config(tmp_path)
    assert cfg.ssd is not None
    _persist(cfg, ["k"])
    ssd = BlockingGets(open_ssd_backend(cfg.ssd))
    store = TieredStore(cfg, ssd=ssd).start()
    buf = np.zeros(OBJ, dtype=np.uint8)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(store.get_into(["k"], [buf])), daemon=True)
    reader.start()
    try:
        assert ssd.entered.wait(10)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        store.close(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        assert ssd.closes == 0, "the SSD tier was closed under a read still running"
        assert store.metrics_counters.store.thread_join_timeouts >= 1  # the call in flight
        assert _warned(caplog, "tiers stay open", "calls in flight: 1")
    finally:
        ssd.release.set()
        reader.join(10)
    assert not ssd.closed_under_a_read
    assert got and got[0][0].status is Status.OK, got  # type: ignore[index]
    np.testing.assert_array_equal(buf, payload("k", OBJ))
    assert ssd.closes == 1  # the call, the tier's last user, closed it as it left
    with TieredStore(cfg) as again:
        assert again.contains(["k"]) == [True]


def test_a_read_left_running_by_close_never_reads_another_file_through_a_reused_descriptor(tmp_path,
                                                                                           monkeypatch) -> None:
    """Bucket backend on the POSIX engine with O_DIRECT: the pool's reads hang in the syscall when
    close() gives up on the get_into; the process then opens other files (descriptor numbers are
    reused). Once the disk answers, the read still gets its own bytes, and nothing good is dropped
    as corrupt."""
    cfg = load_config({"dram": {"capacity_bytes": 8 * MiB},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "bucket",
                               "io_engine": "posix", "bucket_size_bytes": 1 * MiB, "bucket_max_keys": 1,
                               "admission_policy": "all"},
                       "offload": {"policy": "eager"}})
    keys = ["a", "b"]
    _persist(cfg, keys)
    real_preadv = os.preadv
    release, entered = threading.Event(), threading.Event()

    def hung_disk(fd, bufs, offset, *a):  # noqa: ANN001, ANN002, ANN202
        if threading.current_thread().name.startswith("kv-posix-io") and not release.is_set():
            entered.set()
            release.wait(30)
        return real_preadv(fd, bufs, offset, *a)

    store = TieredStore(cfg).start()
    monkeypatch.setattr(os, "preadv", hung_disk)
    out = [np.zeros(OBJ, dtype=np.uint8) for _ in keys]
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(store.get_into(keys, out)), daemon=True)
    reader.start()
    other = tmp_path / "unrelated.bin"
    other.write_bytes(b"\xab" * (2 * MiB))
    fds: list[int] = []
    try:
        assert entered.wait(10), "the pool never reached the disk"
        store.close(timeout_s=0.5)
        fds = [os.open(other, os.O_RDONLY) for _ in range(8)]  # would take the numbers close() freed
    finally:
        release.set()
        reader.join(20)
        for fd in fds:
            os.close(fd)
    monkeypatch.undo()
    assert got and [r.status for r in got[0]] == [Status.OK, Status.OK], got  # type: ignore[union-attr]
    for k, o in zip(keys, out):
        np.testing.assert_array_equal(o, payload(k, OBJ))
    with TieredStore(cfg) as again:  # the tier was closed by the call as it left: the lock is free
        assert again.contains(keys) == [True, True]
        assert again.metrics()["ssd"]["corrupt_reads"] == 0


class SlowPuts:
    """A real backend whose writes wait until ``release`` is set (a hung disk), whoever writes."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name
        self.entered, self.release = threading.Event(), threading.Event()
        self.writers: list[str] = []

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        self.writers.append(threading.current_thread().name)
        self.entered.set()
        self.release.wait(30)
        return self.inner.put(keys, buffers)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


@pytest.mark.parametrize(("policy", "started"), [("watermark", True), ("eager", False)])
def test_close_in_watermark_mode_with_a_hung_ssd_is_bounded_and_the_late_write_lands(tmp_path, policy,
                                                                                     started, caplog) -> None:
    """In watermark mode (or when the workers never started) the flush inside close writes what
    is dirty itself; on a hung SSD that write must not hold close past its timeout."""
    cfg = _config(tmp_path, policy=policy)
    assert cfg.ssd is not None
    ssd = SlowPuts(open_ssd_backend(cfg.ssd))
    store = TieredStore(cfg, ssd=ssd)
    if started:
        store.start()
    try:
        for k in ("k1", "k2"):
            assert store.put([k], [payload(k, OBJ)]) == [Status.OK]
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        store.close(timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert ssd.entered.is_set()
        assert elapsed < 1.5, f"close(timeout_s=0.5) took {elapsed:.2f} s"
        assert store.metrics_counters.store.thread_join_timeouts >= 1  # the close's flush
        assert _warned(caplog, "tiers stay open", "kv-close-flush")
    finally:
        ssd.release.set()
    _join_named("kv-close-flush")
    with TieredStore(cfg) as again:  # the flush, last user of the tier, closed it
        assert again.contains(["k1", "k2"]) == [True, True]


def test_close_bounds_the_ssd_engines_own_wait_and_counts_its_stuck_thread(tmp_path, monkeypatch, caplog) -> None:
    """An I/O pool thread of the SSD tier's engine still in a read at close (its caller gone): the
    store's close waits for it only until its own deadline, not the engine's 10 s, and counts it."""
    from store_backend.ssd.bucket import BucketBackend
    from store_backend.ssd.io.factory import make_io_engine
    from store_backend.ssd.io.requests import IoRequest

    cfg = load_config({"dram": {"capacity_bytes": 8 * MiB},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "bucket",
                               "io_engine": "posix", "admission_policy": "all"},
                       "offload": {"policy": "eager"}})
    assert cfg.ssd is not None
    # The backend owns its engine, as one the store opens itself would; the test keeps a handle.
    engine = make_io_engine(cfg.ssd.io_engine, queue_depth=cfg.ssd.queue_depth, threads=cfg.ssd.io_threads)
    store = TieredStore(cfg, ssd=BucketBackend(cfg.ssd, engine, owns_engine=True)).start()
    real_preadv = os.preadv
    release, entered = threading.Event(), threading.Event()

    def hung_disk(fd, bufs, offset, *a):  # noqa: ANN001, ANN002, ANN202
        if threading.current_thread().name.startswith("kv-posix-io") and not release.is_set():
            entered.set()
            release.wait(30)
        return real_preadv(fd, bufs, offset, *a)

    path = tmp_path / "side"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    monkeypatch.setattr(os, "preadv", hung_disk)
    side = threading.Thread(target=lambda: engine.read([IoRequest(fd, 0, [bytearray(4096)]),
                                                        IoRequest(fd, 4096, [bytearray(4096)])]), daemon=True)
    side.start()
    try:
        assert entered.wait(10)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        store.close(timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert elapsed < 1.5, f"close(timeout_s=0.5) took {elapsed:.2f} s"
        assert store.metrics_counters.store.thread_join_timeouts >= 1  # the pool thread(s) in the read
        assert _warned(caplog, "posix io engine", "kv-posix-io", "did not stop")
    finally:
        release.set()
        side.join(10)
        os.close(fd)


class BlockingPromotions:
    """A real backend whose reads from the promotion worker wait until ``release`` is set."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name
        self.entered, self.release = threading.Event(), threading.Event()
        self.outcome: list[object] = []

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        if threading.current_thread().name != "kv-promote":
            return self.inner.get_into(keys, buffers)
        self.entered.set()
        self.release.wait(30)
        res = self.inner.get_into(keys, buffers)
        self.outcome.append([r.status for r in res])
        return res

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_a_promotion_left_running_by_close_finishes_harmlessly_and_closes_the_tier(tmp_path, caplog) -> None:
    cfg = _config(tmp_path)
    assert cfg.ssd is not None
    _persist(cfg, ["k"])
    ssd = BlockingPromotions(open_ssd_backend(cfg.ssd))
    store = TieredStore(cfg, ssd=ssd).start()
    try:
        buf = np.empty(OBJ, dtype=np.uint8)
        for _ in range(2):  # promotion.admission_hits = 2: the second SSD hit queues a promotion
            assert store.get_into(["k"], [buf])[0].status is Status.OK
        assert ssd.entered.wait(10), "the promotion never began"
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        store.close(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        assert store.metrics_counters.store.thread_join_timeouts >= 1
        assert _warned(caplog, "kv-promote", "did not stop")
    finally:
        ssd.release.set()
    _join_named("kv-promote")
    assert ssd.outcome == [[Status.OK]]
    assert store.metrics_counters.store.worker_errors == 0
    with TieredStore(cfg) as again:  # the worker, last user of the tier, closed it as it ended
        buf = np.empty(OBJ, dtype=np.uint8)
        assert again.get_into(["k"], [buf])[0].status is Status.OK
        np.testing.assert_array_equal(buf, payload("k", OBJ))


def test_close_closes_every_tier_below_dram(tmp_path) -> None:
    """A tier after the SSD one (a pool) is owned by the store too: its close() closes it."""
    from tests.store_backend.test_tiers import DictTier

    class ClosingTier(DictTier):
        def __init__(self) -> None:
            super().__init__()
            self.closes = 0

        def close(self) -> None:
            self.closes += 1

    cfg = _config(tmp_path)
    assert cfg.ssd is not None
    pool = ClosingTier()
    store = TieredStore(cfg, ssd=open_ssd_backend(cfg.ssd), tiers=[pool]).start()
    assert store.put(["k"], [payload("k", OBJ)]) == [Status.OK]
    store.close(timeout_s=10)
    assert pool.closes == 1
    with TieredStore(cfg) as again:  # and the SSD tier's directory lock was released
        assert again.contains(["k"]) == [True]
