"""``flush`` means persisted: True only when every object put before it that admission accepts is
on SSD, else a report naming each one that is not and why; ``close(flush=True)`` persists too."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from store_backend.coherence import LossLedger
from store_backend.config import load_config
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.test_store_tiered import CHUNK, FlakySsd, SlowSsd, read_ok, tiered, tiered_with_ssd
from tests.support.store_views import leased_dram_bytes

MiB = 1 << 20
BACKENDS = ["bucket", "offset", "file"]


def reopen(tmp_path, backend: str, policy: str) -> TieredStore:
    return tiered(tmp_path, backend, dram=8 * MiB, policy=policy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_watermark_flush_persists_everything_not_only_down_to_the_low_mark(tmp_path, backend) -> None:
    keys = [f"k{i}" for i in range(20)]  # 5 MiB in 8 MiB of DRAM: below the high mark
    s, ssd = tiered_with_ssd(tmp_path, backend, dram=8 * MiB, policy="watermark")
    assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 20
    report = s.flush_report(timeout_s=60)
    assert report.ok and not report.unpersisted, report
    assert ssd.contains(keys) == [True] * 20
    assert s.tier_of(keys) == ["dram"] * 20  # written, not demoted: still served from DRAM
    s.close()
    with reopen(tmp_path, backend, "watermark") as s2:
        assert s2.tier_of(keys) == ["ssd"] * 20
        assert all(read_ok(s2, keys))


@pytest.mark.parametrize("policy", ["eager", "watermark"])
def test_close_with_flush_persists_in_both_modes(tmp_path, policy) -> None:
    keys = [f"k{i}" for i in range(20)]
    s = reopen(tmp_path, "bucket", policy)
    assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 20
    s.close()  # no flush() first: close(flush=True) alone must persist
    with reopen(tmp_path, "bucket", policy) as s2:
        assert s2.tier_of(keys) == ["ssd"] * 20 and all(read_ok(s2, keys))


def test_close_without_flush_does_not_write() -> None:
    ssd = SlowSsd(delay_s=0.0)
    s = TieredStore({"dram": {"capacity_bytes": 8 * MiB}, "offload": {"policy": "watermark"}}, ssd=ssd).start()
    s.put(["a"], [payload("a", CHUNK)])
    s.close(flush=False)
    assert ssd.data == {}


class BrokenKeysSsd(SlowSsd):
    """An SSD on which every write of a key starting with ``prefix`` fails (a broken region)."""

    def __init__(self, prefix: str) -> None:
        super().__init__(delay_s=0.0)
        self.prefix = prefix

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        return [Status.IO_ERROR if k.startswith(self.prefix) else super(BrokenKeysSsd, self).put([k], [b])[0]
                for k, b in zip(keys, buffers)]


def test_flush_names_objects_dropped_after_their_writes_kept_failing() -> None:
    """The one way an acknowledged object leaves DRAM before it reached SSD: its SSD write failed
    MAX_OFFLOAD_ATTEMPTS times (a broken disk). Each is counted, and named by every later flush
    (a slow SSD no longer loses anything: see test_store_burst.py)."""
    ssd = BrokenKeysSsd("bad")
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB, "eviction_policy": "lru"},
                     "offload": {"policy": "eager", "put_wait_s": 30.0}}, ssd=ssd).start()
    try:
        keys = [f"bad{i}" for i in range(12)]  # 3 MiB through 2 MiB, and no write ever lands
        assert [s.put([k], [payload(k, CHUNK)])[0] for k in keys] == [Status.OK] * 12
        lost, kept = keys[:4], keys[4:]  # each put past the 8th dropped the oldest, once given up
        m = s.metrics()
        assert m["store"]["dropped_unpersisted"] == 4 and m["ssd"]["failures"]["io_error"] >= 4 * 3, m
        assert s.tier_of(keys) == [None] * 4 + ["dram"] * 8
        report = s.flush_report(timeout_s=60)
        assert not report.ok and s.flush(timeout_s=60) is False
        assert sorted(report.unpersisted) == sorted(keys)
        assert all(report.unpersisted[k] == "evicted from DRAM before it reached SSD (3 failed or refused writes)"
                   for k in lost), report.unpersisted
        assert all(report.unpersisted[k] == "its SSD write answered IO_ERROR" for k in kept), report.unpersisted
        assert "objects not on SSD" in report.summary()
        # A lost object put again (dropping the oldest one given up, bad4), or removed, is no longer
        # reported as lost.
        assert s.put(["bad0"], [payload("bad0", CHUNK)]) == [Status.OK]
        s.remove(["bad1"])
        again = s.flush_report(timeout_s=60)
        assert "bad1" not in again.unpersisted
        evicted = sorted(k for k, why in again.unpersisted.items() if why.startswith("evicted"))
        assert evicted == ["bad2", "bad3", "bad4"]
        assert again.unpersisted["bad0"] == "its SSD write answered IO_ERROR"  # in DRAM again, still unwritable
    finally:
        s.close(flush=False)


@pytest.mark.parametrize("failures,ok", [(1, True), (2, True), (3, False)])
def test_flush_retries_failed_writes_and_names_what_still_failed(failures, ok) -> None:
    ssd = FlakySsd("k0", failures)
    with TieredStore({"dram": {"capacity_bytes": 8 * MiB}, "offload": {"policy": "watermark"}}, ssd=ssd) as s:
        s.put(["k0", "k1"], [payload("k0", CHUNK), payload("k1", CHUNK)])
        report = s.flush_report(timeout_s=30)
        assert report.ok is ok and ("k0" in ssd.data) is ok and "k1" in ssd.data
        if not ok:
            assert dict(report.unpersisted) == {"k0": "its SSD write answered IO_ERROR"}


def test_flush_timeout_names_what_it_did_not_write() -> None:
    ssd = SlowSsd(delay_s=2.0)  # the write in flight outlasts the flush by far
    s = TieredStore({"dram": {"capacity_bytes": 8 * MiB}, "offload": {"policy": "eager"}}, ssd=ssd).start()
    try:
        s.put(["a", "b"], [payload("a", CHUNK), payload("b", CHUNK)])
        report = s.flush_report(timeout_s=0.05)
        assert not report.ok and set(report.unpersisted) == {"a", "b"}
        assert all("timed out" in why for why in report.unpersisted.values())
        assert s.flush(timeout_s=30)
    finally:
        s.close()


def test_flush_writes_again_a_dram_object_whose_ssd_copy_is_gone(tmp_path) -> None:
    s, ssd = tiered_with_ssd(tmp_path, "offset", dram=8 * MiB)
    with s:
        s.put(["a"], [payload("a", CHUNK)])
        assert s.flush(timeout_s=30)
        assert ssd.remove(["a"]) == [Status.OK]  # as the SSD tier's eviction would
        assert s.flush(timeout_s=30) and ssd.contains(["a"]) == [True]


def test_declined_objects_do_not_fail_a_flush(tmp_path) -> None:
    s, ssd = tiered_with_ssd(tmp_path, "bucket", dram=8 * MiB, policy="watermark")
    with s:  # admission "prefix"
        s.put(["orphan-child"], [payload("c", CHUNK)], parents=["parent-stored-nowhere"])
        s.put(["root"], [payload("r", CHUNK)])
        report = s.flush_report(timeout_s=30)
        assert report.ok and report.declined == 1
        assert ssd.contains(["orphan-child", "root"]) == [False, True]


def test_without_an_ssd_tier_flush_is_trivially_true() -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 * MiB}}) as s:
        s.put(["a"], [b"x"])
        assert s.flush() is True and s.flush_report().ok


class SlowPuts:
    """Fault injection around a real backend: every SSD write first waits ``delay_s``."""

    def __init__(self, inner, delay_s: float) -> None:  # noqa: ANN001
        self.inner, self.name, self.delay_s = inner, inner.name, delay_s

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        time.sleep(self.delay_s)  # the simulated slow SSD write
        return self.inner.put(keys, buffers)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def wrapped_store(tmp_path, wrap, **sections) -> TieredStore:  # noqa: ANN001
    return wrapped_store_and_ssd(tmp_path, wrap, **sections)[0]


def wrapped_store_and_ssd(tmp_path, wrap, **sections):  # noqa: ANN001, ANN201
    """A store over ``wrap(`` an SSD backend ``)``; and that wrapper (the store owns it)."""
    cfg = {"dram": {"capacity_bytes": 8 * MiB, "eviction_policy": "lru"},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 256 * MiB, "backend": "bucket",
                   "bucket_size_bytes": 1 * MiB, "admission_policy": "all"},
           "offload": {"policy": "eager"}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    config = load_config(cfg)
    assert config.ssd is not None
    ssd = wrap(open_ssd_backend(config.ssd))
    return TieredStore(config, ssd=ssd), ssd


def test_eager_flush_returns_under_steady_put_traffic(tmp_path) -> None:
    """Puts keep the offload queue busy (the SSD is slower than they are) the whole time: the
    flush must return once the objects put before it are on SSD, not when the traffic stops."""
    obj = 16 * 1024
    s, ssd = wrapped_store_and_ssd(tmp_path, lambda inner: SlowPuts(inner, 0.005),
                                   offload={"policy": "eager", "batch_bytes": 2 * obj})
    s.start()
    stop = threading.Event()
    data = np.ones(obj, np.uint8)
    pre = [f"pre{i}" for i in range(10)]
    try:
        assert s.put(pre, [data] * 10) == [Status.OK] * 10
        done = [0]

        def producer() -> None:
            n = 0
            while not stop.is_set():
                s.put([f"p{n}"], [data])
                n += 1
                if n % 100 == 0 and n >= 200:  # stay well within DRAM (never the pre* keys)
                    s.remove([f"p{j}" for j in range(n - 200, n - 100)])
                done[0] = n

        t = threading.Thread(target=producer)
        t.start()
        deadline = time.monotonic() + 30
        while s.stats().queues.offload < 50 and time.monotonic() < deadline:  # the queue is backed up
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert s.stats().queues.offload >= 50
        got: list = []
        f = threading.Thread(target=lambda: got.append(s.flush_report()))
        f.start()
        f.join(60)  # generous on a loaded machine; the traffic goes on meanwhile
        starved = f.is_alive()
        assert not stop.is_set() and t.is_alive()
        stop.set()
        t.join(30)
        f.join(120)
        assert not starved, "flush() waited for objects put after it began"
        assert got[0].ok, got[0]
        assert ssd.contains(pre) == [True] * 10
    finally:
        stop.set()
        s.close(flush=False)


def test_a_loss_ledger_past_its_bound_forgets_the_oldest_and_reports_them_once() -> None:
    ledger = LossLedger(max_keys=3)
    for seq in range(1, 6):  # k1..k5, put numbers 1..5; k1 and k2 are forgotten
        ledger.record(f"k{seq}", seq, "why")
    assert [k for k, _ in ledger.items(5)] == ["k3", "k4", "k5"]
    assert [k for k, _ in ledger.items(3)] == ["k3"]  # a flush that began before k4 was put
    assert ledger.take_forgotten(0) == 0  # put after that flush began: not its business
    assert ledger.take_forgotten(1) == 2  # may concern it (k1): reported, but k2 is later ...
    assert ledger.take_forgotten(2) == 2  # ... so reported again by a flush that covers both
    assert ledger.take_forgotten(10) == 0  # and by no flush after that
    ledger.clear("k3")
    assert [k for k, _ in ledger.items(10)] == ["k4", "k5"]


class FailingPuts(SlowPuts):
    """Every SSD write of a key starting with ``prefix`` fails (the others reach the real backend)."""

    def __init__(self, inner, prefix: str) -> None:  # noqa: ANN001
        super().__init__(inner, 0.0)
        self.prefix = prefix

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        out = [Status.IO_ERROR] * len(keys)
        todo = [i for i, k in enumerate(keys) if not k.startswith(self.prefix)]
        if todo:
            for i, st in zip(todo, self.inner.put([keys[i] for i in todo], [buffers[i] for i in todo])):
                out[i] = st
        return out


def test_losses_past_the_ledger_bound_do_not_fail_every_later_flush(tmp_path, monkeypatch) -> None:
    """More losses than the ledger remembers: the first flush names what it can and counts the
    rest; once the lost keys are removed, flushes are ok again (not False for good)."""
    import store_backend.store as store_module

    monkeypatch.setattr(store_module, "LossLedger", lambda: LossLedger(4))
    obj = 4096
    # Every write of lost-x0..11 fails: each is dropped for a later put once its attempts are used
    # up. x12..19 are written fine and pinned, so that only those given up can make room.
    s = wrapped_store(tmp_path, lambda inner: FailingPuts(inner, "lost-"), dram={"capacity_bytes": 8 * obj},
                      offload={"policy": "eager", "put_wait_s": 30.0}).start()
    try:
        keys = [f"lost-x{i}" for i in range(12)] + [f"x{i}" for i in range(12, 20)]
        for k in keys:
            assert s.put([k], [np.zeros(obj, np.uint8)]) == [Status.OK]
            if not k.startswith("lost-"):
                assert s.pin([k], ttl_s=60) == [True]
        assert s.metrics()["store"]["dropped_unpersisted"] == 12
        first = s.flush_report()
        assert not first.ok and sorted(first.unpersisted) == ["lost-x10", "lost-x11", "lost-x8", "lost-x9"]
        assert first.lost_untracked == 8 and "12 objects not on SSD" in first.summary()
        assert s.remove(keys[:12]) == [Status.NOT_FOUND] * 12
        second = s.flush_report()
        assert second.ok, second
        assert s.flush() is True
        s.unpin(keys[12:])
    finally:
        s.close(flush=False)


def test_a_flush_does_not_report_losses_of_objects_put_after_it_began(tmp_path) -> None:
    """A loss recorded while a flush runs, of an object put after the flush began, belongs to a
    later flush (the first one's snapshot never held it)."""
    obj = 64 * 1024
    gate, entered = threading.Event(), threading.Event()

    class GatedPuts(FailingPuts):
        def put(self, keys, buffers):  # noqa: ANN001, ANN201
            if threading.current_thread().name == "flusher" and not entered.is_set():
                entered.set()
                assert gate.wait(30)
            return super().put(keys, buffers)

    s = wrapped_store(tmp_path, lambda inner: GatedPuts(inner, "late"), dram={"capacity_bytes": 8 * obj},
                      offload={"policy": "eager", "put_wait_s": 30.0})
    try:
        assert s.put(["a"], [np.ones(obj, np.uint8)]) == [Status.OK]  # before start(): the flush writes it
        s.start()
        got: list = []
        f = threading.Thread(target=lambda: got.append(s.flush_report()), name="flusher")
        f.start()
        assert entered.wait(10)  # the flush is writing "a"
        later = [f"late{i}" for i in range(12)]  # put after the flush began; their writes keep failing,
        for k in later:  # so DRAM drops some of them once their attempts are used up
            assert s.put([k], [np.ones(obj, np.uint8)]) == [Status.OK]
        assert s.metrics()["store"]["dropped_unpersisted"] > 0
        gate.set()
        f.join(60)
        assert got and got[0].ok, got
        assert not s.flush_report().ok  # a flush that began after those losses reports them
    finally:
        gate.set()
        s.close(flush=False)


def test_concurrent_flushes_together_lease_at_most_half_of_dram(tmp_path) -> None:
    """Three flushes write at once on a slow SSD: all SSD writes together hold at most half of
    DRAM. A put that needs room meanwhile finds only objects not on SSD yet: it drops none of them
    (it used to drop one), it answers NO_SPACE at once with no wait asked for, and one that may wait
    gets its room as soon as the write lands."""
    obj = 64 * 1024
    gate = threading.Event()
    inside: list[str] = []

    class GatedPuts(SlowPuts):
        def put(self, keys, buffers):  # noqa: ANN001, ANN201
            inside.append(threading.current_thread().name)
            assert gate.wait(30)
            return self.inner.put(keys, buffers)

    s = wrapped_store(tmp_path, lambda inner: GatedPuts(inner, 0.0), dram={"capacity_bytes": 16 * obj},
                      offload={"policy": "watermark", "high_watermark": 0.99, "low_watermark": 0.98,
                               "write_threads": 2})
    flushers = [threading.Thread(target=s.flush, kwargs={"timeout_s": 60}, name=f"flusher{i}") for i in range(3)]
    try:  # not started: only the flushing callers write
        keys = [f"a{i}" for i in range(16)]
        assert s.put(keys, [np.ones(obj, np.uint8)] * 16) == [Status.OK] * 16  # DRAM is full
        for t in flushers:
            t.start()
        deadline = time.monotonic() + 10
        while not inside and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert inside
        wait_until(lambda: len(inside) >= 2, 10, "a second flusher writing")
        time.sleep(1.0)  # the window in which the third flusher must not start a write of its own
        leased = leased_dram_bytes(s)
        # Each write leases at most its share of the half (offload.write_threads, 2: a quarter).
        assert leased <= 8 * obj and len(inside) == 2, (leased, inside)
        [refused] = s.reserve(["new"], [obj], room_wait_s=0)
        assert refused.status is Status.NO_SPACE and s.stats().store.put_no_space_dirty == 1
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(s.reserve(["new"], [obj], room_wait_s=30)))
        waiter.start()
        time.sleep(0.3)  # the window in which the reserve must not return: not a wait for a condition
        assert waiter.is_alive() and not got  # waiting for the write that holds the room
        gate.set()
        waiter.join(30)
        assert [r.status for r in got] == [Status.OK]
        s.abort(got)
        assert s.stats().store.dropped_unpersisted == 0 and s.stats().store.put_room_waits == 1
    finally:
        gate.set()
        for t in flushers:
            t.join(60)
        s.close(flush=False)
    assert not any(t.is_alive() for t in flushers)


def test_objects_the_offload_queue_refused_to_take_back_are_written_before_dram_drops_them(tmp_path) -> None:
    """A write with no room left (other writes hold half of DRAM) puts its objects back on the
    offload queue; a tiny queue refuses some. The next time DRAM needs room, eviction meets them
    and queues them again, so they reach SSD (rather than staying unwritten in DRAM; a refusal is
    not a failed write, so it never brings them nearer to being dropped)."""
    unit = 16 * 1024
    gate, entered = threading.Event(), threading.Event()

    class GatedPuts(SlowPuts):
        def put(self, keys, buffers):  # noqa: ANN001, ANN201
            if threading.current_thread().name == "f1":
                entered.set()
                assert gate.wait(30)
            return self.inner.put(keys, buffers)

    s, ssd = wrapped_store_and_ssd(tmp_path, lambda inner: GatedPuts(inner, 0.0), dram={"capacity_bytes": 8 * unit},
                                   offload={"policy": "watermark", "high_watermark": 1.0, "low_watermark": 0.5,
                                            "queue_max_objects": 2, "write_threads": 1})
    s.start()  # one write: all the half
    try:
        assert s.put(["big"], [np.ones(3 * unit, np.uint8)]) == [Status.OK]
        small = ["a", "b", "c", "d"]
        assert s.put(small, [np.ones(unit, np.uint8)] * 4) == [Status.OK] * 4  # 7 of 8 units
        f1 = threading.Thread(target=s.flush, kwargs={"timeout_s": 1.0}, name="f1")
        f1.start()
        assert entered.wait(10)  # f1 writes "big" and "a": half of DRAM, all the room there is
        t0 = time.monotonic()  # f1 began before this: its deadline is before t0 + 1.0
        # No room: b, c, d go back to the offload queue, which takes two; "d" is refused.
        assert not s.flush_report(timeout_s=0.3).ok
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))  # f1's deadline has passed ...
        gate.set()  # ... so after this write it stops: "d" is left to the background
        f1.join(30)
        deadline = time.monotonic() + 30
        while s.stats().queues.offload and time.monotonic() < deadline:  # "b" and "c" are written
            time.sleep(0.01)  # poll interval; the loop has a deadline
        inner = ssd.inner
        assert inner.contains(["big", "a", "b", "c", "d"]) == [True, True, True, True, False]
        out = np.zeros(3 * unit, np.uint8)
        for k in ["big", "a", "b", "c"]:  # "d" becomes the least recently used
            assert s.get_into([k], [out])[0].status is Status.OK
        # DRAM needs room: eviction meets "d" first and queues it again rather than skip it for good.
        assert s.put(["e", "f"], [np.ones(unit, np.uint8)] * 2) == [Status.OK] * 2
        deadline = time.monotonic() + 30
        while inner.contains(["d"]) != [True] and time.monotonic() < deadline:
            time.sleep(0.02)  # poll interval; the loop has a deadline
        assert inner.contains(["d"]) == [True]
        assert s.metrics()["store"]["offload_retries"] >= 1
    finally:
        gate.set()
        s.close(flush=False)


def test_flush_returns_under_steady_reads_that_queue_promotions(tmp_path) -> None:
    """Reads of SSD-only objects keep queuing promotions (each promotion read is slow): the flush
    waits only for the promotions queued before it, not for those the reads queue meanwhile."""
    obj = 16 * 1024

    class SlowPromotions(SlowPuts):
        def put(self, keys, buffers):  # noqa: ANN001, ANN201
            return self.inner.put(keys, buffers)

        def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
            if threading.current_thread().name == "kv-promote":
                time.sleep(self.delay_s)  # the simulated slow promotion read
            return self.inner.get_into(keys, buffers)

    s = wrapped_store(tmp_path, lambda inner: SlowPromotions(inner, 0.01),
                      dram={"capacity_bytes": 8 * obj},
                      promotion={"enabled": True, "admission_hits": 1}).start()
    stop = threading.Event()
    try:
        keys = [f"k{i}" for i in range(64)]
        for k in keys:
            assert s.put([k], [np.ones(obj, np.uint8)]) == [Status.OK]
            assert s.flush(timeout_s=30)

        def reader() -> None:
            out = np.zeros(obj, np.uint8)
            i = 0
            while not stop.is_set():
                s.get_into([keys[i % len(keys)]], [out])
                i += 1

        t = threading.Thread(target=reader)
        t.start()
        deadline = time.monotonic() + 30
        while s.stats().queues.promotion < 10 and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert s.stats().queues.promotion >= 10
        got: list = []
        f = threading.Thread(target=lambda: got.append(s.flush_report()))
        f.start()
        f.join(60)
        starved = f.is_alive()
        assert t.is_alive()
        stop.set()
        t.join(30)
        f.join(120)
        assert not starved, "flush() waited for promotions queued after it began"
        assert got[0].ok, got[0]
    finally:
        stop.set()
        s.close(flush=False)
