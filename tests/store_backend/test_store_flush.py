"""``flush`` means persisted: True only when every object put before it that admission accepts is
on SSD, else a report naming each one that is not and why; ``close(flush=True)`` persists too."""

from __future__ import annotations

import pytest

from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload
from tests.store_backend.test_store_tiered import CHUNK, FlakySsd, SlowSsd, read_ok, tiered

MiB = 1 << 20
BACKENDS = ["bucket", "offset", "file"]


def reopen(tmp_path, backend: str, policy: str) -> TieredStore:
    return tiered(tmp_path, backend, dram=8 * MiB, policy=policy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_watermark_flush_persists_everything_not_only_down_to_the_low_mark(tmp_path, backend) -> None:
    keys = [f"k{i}" for i in range(20)]  # 5 MiB in 8 MiB of DRAM: below the high mark
    s = reopen(tmp_path, backend, "watermark")
    assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 20
    report = s.flush_report(timeout_s=60)
    assert report.ok and not report.unpersisted, report
    assert s._ssd is not None and s._ssd.contains(keys) == [True] * 20
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


def test_eager_flush_names_objects_dropped_before_they_reached_ssd() -> None:
    ssd = SlowSsd(delay_s=0.2)  # far slower than the puts: DRAM must drop unpersisted objects
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager"}}, ssd=ssd).start()
    try:
        keys = [f"k{i}" for i in range(40)]
        stored = [k for k in keys if s.put([k], [payload(k, CHUNK)]) == [Status.OK]]  # else NO_SPACE
        assert s.metrics()["store"]["dropped_unpersisted"] > 0
        report = s.flush_report(timeout_s=60)
        assert not report.ok and s.flush(timeout_s=60) is False
        lost = [k for k in stored if k not in ssd.data]
        assert len(lost) >= 3 and sorted(report.unpersisted) == sorted(lost)
        assert all("evicted from DRAM before it reached SSD" in report.unpersisted[k] for k in lost)
        assert "objects not on SSD" in report.summary()
        # A lost object put again, or removed, is no longer reported.
        s.put([lost[0]], [payload(lost[0], CHUNK)])
        s.remove([lost[1]])
        again = s.flush_report(timeout_s=60)
        assert lost[0] not in again.unpersisted and lost[1] not in again.unpersisted
        assert sorted(again.unpersisted) == sorted(lost[2:])
    finally:
        s.close()


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
    with tiered(tmp_path, "offset", dram=8 * MiB) as s:
        s.put(["a"], [payload("a", CHUNK)])
        assert s.flush(timeout_s=30)
        assert s._ssd is not None and s._ssd.remove(["a"]) == [Status.OK]  # as the SSD tier's eviction would
        assert s.flush(timeout_s=30) and s._ssd.contains(["a"]) == [True]


def test_declined_objects_do_not_fail_a_flush(tmp_path) -> None:
    with tiered(tmp_path, "bucket", dram=8 * MiB, policy="watermark") as s:  # admission "prefix"
        s.put(["orphan-child"], [payload("c", CHUNK)], parents=["parent-stored-nowhere"])
        s.put(["root"], [payload("r", CHUNK)])
        report = s.flush_report(timeout_s=30)
        assert report.ok and report.declined == 1
        assert s._ssd is not None and s._ssd.contains(["orphan-child", "root"]) == [False, True]


def test_without_an_ssd_tier_flush_is_trivially_true() -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 * MiB}}) as s:
        s.put(["a"], [b"x"])
        assert s.flush() is True and s.flush_report().ok
