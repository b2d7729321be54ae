"""A write burst faster than the SSD loses no acknowledged object (issue 23, item 5).

200 puts of 1 MiB, one call each as fast as the store takes them, into a 64 MiB DRAM tier over an
SSD tier with room for all of them, on the real disk (O_DIRECT where the file system allows it):
every put answered OK must be readable, byte for byte, after ``flush``. NO_SPACE answers are
allowed (the newest puts give way). Before the fix, DRAM dropped objects it had acknowledged and
not yet written ("evicted from DRAM before it reached SSD": 10-47 % of them). The throughput
figures of the same scenario are a benchmark (``mooncake-kv bench store``), not a timed test.
"""

from __future__ import annotations

import numpy as np
import pytest

from store_backend.config import OffloadConfig
from store_backend.store import TieredStore
from store_backend.types import Status

MiB = 1 << 20
OBJECT = 1 * MiB
PUTS = 200


def _object(base: np.ndarray, i: int) -> np.ndarray:
    """Object ``i``'s bytes: distinct per object, so a read of another object's bytes shows."""
    return np.roll(base, i * 4099 + 1)


@pytest.mark.parametrize("put_wait_s", [0.0, OffloadConfig().put_wait_s], ids=["refuse", "default-wait"])
@pytest.mark.parametrize("backend", ["bucket", "offset", "file"])
def test_every_acknowledged_object_of_a_burst_is_readable_after_flush(tmp_path, backend, put_wait_s) -> None:
    cfg = {"dram": {"capacity_bytes": 64 * MiB},
           "ssd": {"path": str(tmp_path / "ssd"), "backend": backend, "capacity_bytes": 1024 * MiB},
           "offload": {"put_wait_s": put_wait_s}}
    base = np.random.default_rng(23).integers(0, 256, OBJECT, dtype=np.uint8)
    keys = [f"burst/{i}" for i in range(PUTS)]
    with TieredStore(cfg) as s:
        statuses = [s.put([k], [_object(base, i)])[0] for i, k in enumerate(keys)]
        assert set(statuses) <= {Status.OK, Status.NO_SPACE}, set(statuses)
        acked = [i for i, st in enumerate(statuses) if st is Status.OK]
        assert acked, "no put was stored"
        report = s.flush_report(timeout_s=120)
        out = np.empty(OBJECT, np.uint8)
        lost = []
        for i in acked:
            res = s.get_into([keys[i]], [out])[0]
            if res.status is not Status.OK or res.nbytes != OBJECT or not np.array_equal(out, _object(base, i)):
                lost.append((keys[i], res.status.name, report.unpersisted.get(keys[i])))
        m = s.metrics()["store"]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged objects lost: {lost[:5]}"
        assert report.ok, report.summary()
        assert m["dropped_unpersisted"] == 0
        assert m["put_no_space_dirty"] == statuses.count(Status.NO_SPACE)


@pytest.mark.parametrize("marks", [(0.9, 0.7), (1.0, 0.5)], ids=["default-marks", "never-demotes"])
def test_watermark_mode_keeps_every_acknowledged_object_of_a_burst(tmp_path, marks) -> None:
    """Watermark mode writes only when DRAM passes its high mark; a burst into a full DRAM still
    drops nothing it acknowledged: demotion writes before it frees, and eviction queues the writes
    it needs itself (also with a high mark of 1.0, where no demotion pass ever runs)."""
    high, low = marks
    cfg = {"dram": {"capacity_bytes": 16 * MiB},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 256 * MiB},
           "offload": {"policy": "watermark", "high_watermark": high, "low_watermark": low, "put_wait_s": 10}}
    base = np.random.default_rng(5).integers(0, 256, OBJECT, dtype=np.uint8)
    keys = [f"w/{i}" for i in range(64)]  # 64 MiB through 16 MiB
    with TieredStore(cfg) as s:
        assert [s.put([k], [_object(base, i)])[0] for i, k in enumerate(keys)] == [Status.OK] * 64
        assert s.flush(timeout_s=60)
        out = np.empty(OBJECT, np.uint8)
        for i, k in enumerate(keys):
            assert s.get_into([k], [out])[0].status is Status.OK and np.array_equal(out, _object(base, i)), k
        assert s.stats().store.dropped_unpersisted == 0


def test_without_running_workers_a_full_dram_refuses_at_once_and_drops_nothing(tmp_path) -> None:
    """Not started: nothing writes in the background, so waiting would only stall. A put into a DRAM
    full of objects not on SSD answers NO_SPACE at once (it used to drop the oldest unwritten one);
    once a flush has written them, they make room again."""
    cfg = {"dram": {"capacity_bytes": 8 * MiB},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB},
           "offload": {"put_wait_s": 30}}
    s = TieredStore(cfg)  # not started
    try:
        data = np.ones(OBJECT, np.uint8)
        assert s.put([f"k{i}" for i in range(8)], [data] * 8) == [Status.OK] * 8
        assert s.put(["late"], [data]) == [Status.NO_SPACE]  # at once: no 30 s wait
        assert s.stats().store.put_no_space == 1 and s.stats().store.put_room_waits == 0
        assert s.flush(timeout_s=60)
        assert s.put(["late"], [data]) == [Status.OK]
        assert s.stats().store.dropped_unpersisted == 0
    finally:
        s.close(flush=False)


def test_reserve_waits_only_when_asked(tmp_path) -> None:
    cfg = {"dram": {"capacity_bytes": 8 * MiB}, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB}}
    with TieredStore(cfg) as s:
        for bad in (-1, float("nan"), float("inf"), True, "1"):
            with pytest.raises(ValueError, match="room_wait_s"):
                s.reserve(["k"], [OBJECT], room_wait_s=bad)
        res = s.reserve(["k"], [OBJECT], room_wait_s=None)  # the config's put_wait_s
        assert [r.status for r in res] == [Status.OK]
        assert s.commit(res) == [Status.OK]
