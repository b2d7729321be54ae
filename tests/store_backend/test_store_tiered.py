"""DRAM over SSD: offload (eager and watermark), eviction to SSD, promotion, restart, slow SSD."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from store_backend.config import ConfigError, load_config
from store_backend.ssd.base import SsdBackend, SsdStats
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload
from tests.support.store_views import leased_dram_bytes

MiB = 1 << 20
CHUNK = 256 * 1024
BACKENDS = ["bucket", "offset", "file"]


def tiered(tmp_path, backend: str = "bucket", dram: int = 2 * MiB, policy: str = "eager", *,
           eviction: str = "prefix_reuse", **extra) -> TieredStore:
    return tiered_with_ssd(tmp_path, backend, dram, policy, eviction=eviction, **extra)[0]


def tiered_with_ssd(tmp_path, backend: str = "bucket", dram: int = 2 * MiB, policy: str = "eager", *,
                    eviction: str = "prefix_reuse", **extra) -> tuple[TieredStore, SsdBackend]:
    """A started store of :func:`tiered`'s config, and its SSD backend (opened here from the same
    config and handed to the store, which owns it), so a test can look at the SSD tier itself."""
    cfg = {
        "dram": {"capacity_bytes": dram, "eviction_policy": eviction},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": backend,
                "bucket_size_bytes": 1 * MiB},
        "offload": {"policy": policy, "high_watermark": 0.8, "low_watermark": 0.5},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    config = load_config(cfg)
    assert config.ssd is not None
    ssd = open_ssd_backend(config.ssd)
    return TieredStore(config, ssd=ssd).start(), ssd


def settle(store: TieredStore, timeout_s: float = 30.0) -> None:
    """Wait for the background workers alone (flush would also write, and retry, on its own)."""
    assert store.wait_idle(timeout_s, events=False)


def read_ok(store: TieredStore, keys: Sequence[str], size: int = CHUNK) -> list[bool]:
    outs = [np.zeros(size, np.uint8) for _ in keys]
    res = store.get_into(keys, outs)
    return [r.status is Status.OK and np.array_equal(o, payload(k, size)) for k, o, r in zip(keys, outs, res)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_offload_then_evicted_objects_come_from_ssd(tmp_path, backend) -> None:
    with tiered(tmp_path, backend) as s:
        keys = [f"k{i}" for i in range(24)]  # 6 MiB through a 2 MiB DRAM tier
        for k in keys:
            assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
            s.flush(timeout_s=30)  # an SSD that keeps up: nothing is dropped
        tiers = s.tier_of(keys)
        assert tiers.count("dram") <= 8 and tiers.count("ssd") >= 16 and None not in tiers
        assert s.exists(keys) == len(keys)
        assert all(read_ok(s, keys))
        m = s.metrics()
        assert m["dram"]["offloads"] == len(keys)
        assert m["ssd"]["hits"] >= 16 and m["dram"]["evictions"] >= 16
        assert m["store"]["dropped_unpersisted"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_promotion_after_admission_hits(tmp_path, backend) -> None:
    with tiered(tmp_path, backend, promotion={"admission_hits": 2}) as s:
        keys = [f"k{i}" for i in range(16)]
        for k in keys:
            s.put([k], [payload(k, CHUNK)])
            s.flush(timeout_s=30)
        cold = keys[0]
        assert s.tier_of([cold]) == ["ssd"]
        assert read_ok(s, [cold]) == [True]
        s.flush(timeout_s=30)
        assert s.tier_of([cold]) == ["ssd"]  # one hit is below the admission threshold
        assert read_ok(s, [cold]) == [True]
        s.flush(timeout_s=30)
        assert s.tier_of([cold]) == ["dram"]
        assert read_ok(s, [cold]) == [True]
        assert s.metrics()["dram"]["promotions"] == 1


def test_a_chunk_reused_in_dram_is_promoted_at_its_first_ssd_hit(tmp_path) -> None:
    """The DRAM policy (prefix_reuse, the default) remembers use counts of objects it moved down:
    one that was hit before it left DRAM comes back at its first SSD hit, not after admission_hits."""
    with tiered(tmp_path, "offset", promotion={"admission_hits": 3}) as s:
        keys = [f"k{i}" for i in range(8)]  # fills the 2 MiB DRAM tier
        for k in keys:
            s.put([k], [payload(k, CHUNK)])
        s.flush(timeout_s=30)
        assert all(read_ok(s, keys))  # every object is now reused (two requests)
        s.put(["new"], [payload("new", CHUNK)])  # evicts the least recently reused: k0
        s.flush(timeout_s=30)
        assert s.tier_of(["k0"]) == ["ssd"]
        assert read_ok(s, ["k0"]) == [True]
        s.flush(timeout_s=30)
        assert s.tier_of(["k0"]) == ["dram"]
        assert s.metrics()["dram"]["promotions"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_watermark_moves_down_to_low_mark(tmp_path, backend) -> None:
    with tiered(tmp_path, backend, dram=4 * MiB, policy="watermark") as s:
        keys = [f"k{i}" for i in range(15)]  # 3.75 MiB: above the 80% mark of 4 MiB
        assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 15
        assert s.flush(timeout_s=30)
        m = s.metrics()
        assert m["dram"]["used_bytes"] <= 0.5 * 4 * MiB
        assert m["dram"]["offloads"] >= 7
        assert s.tier_of(keys[:7]) == ["ssd"] * 7  # the coldest went down first
        assert all(read_ok(s, keys))
        assert m["store"]["dropped_unpersisted"] == 0


def test_restart_serves_everything_persisted(tmp_path) -> None:
    keys = [f"k{i}" for i in range(12)]
    s = tiered(tmp_path, "bucket", dram=8 * MiB)
    s.put(keys, [payload(k, CHUNK) for k in keys])
    s.close()  # flushes queued offloads
    with tiered(tmp_path, "bucket", dram=8 * MiB) as s2:
        assert s2.tier_of(keys) == ["ssd"] * 12
        assert all(read_ok(s2, keys))
        assert s2.put(keys[:1], [b"different"]) == [Status.EXISTS]


def test_keys_lists_every_tier_once(tmp_path) -> None:
    with tiered(tmp_path, "bucket") as s:
        keys = [f"a/{i}" for i in range(12)] + ["b/0"]
        for k in keys:
            s.put([k], [payload(k, CHUNK)])
            s.flush(timeout_s=30)
        assert "dram" in s.tier_of(keys) and "ssd" in s.tier_of(keys)
        assert sorted(s.keys("a/")) == sorted(keys[:-1])
        assert sorted(s.keys()) == sorted(keys)
        assert s.remove(s.keys("a/")) == [Status.OK] * 12
        assert s.keys() == ["b/0"]


def test_remove_reaches_every_tier(tmp_path) -> None:
    with tiered(tmp_path, "offset") as s:
        s.put(["a"], [payload("a", CHUNK)])
        s.flush(timeout_s=30)
        assert s.remove(["a"]) == [Status.OK]
        assert s.contains(["a"]) == [False]
        assert s.get_into(["a"], [bytearray(CHUNK)])[0].status is Status.NOT_FOUND


class SlowSsd:
    """Fault injection: an SSD backend that takes ``delay_s`` per put and stores in a dict."""

    name = "slow"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        time.sleep(self.delay_s)  # the simulated slow SSD write
        with self.lock:
            for k, b in zip(keys, buffers):
                self.data.setdefault(k, bytes(b))
        return [Status.OK] * len(keys)

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        out = []
        for k, b in zip(keys, buffers):
            v = self.data.get(k)
            if v is None:
                out.append(ReadResult(Status.NOT_FOUND))
            else:
                memoryview(b).cast("B")[:len(v)] = v
                out.append(ReadResult(Status.OK, len(v)))
        return out

    def contains(self, keys):  # noqa: ANN001, ANN201
        return [k in self.data for k in keys]

    def size_of(self, keys):  # noqa: ANN001, ANN201
        return [len(self.data[k]) if k in self.data else None for k in keys]

    def remove(self, keys):  # noqa: ANN001, ANN201
        return [Status.OK if self.data.pop(k, None) is not None else Status.NOT_FOUND for k in keys]

    def keys(self):  # noqa: ANN201
        return iter(list(self.data))

    def stats(self) -> SsdStats:
        return SsdStats(objects=len(self.data))

    def close(self) -> None:
        pass


def test_a_slow_ssd_never_blocks_puts_and_the_newest_give_way() -> None:
    """put_wait_s 0: DRAM full of objects the slow SSD has not taken yet refuses the new puts at
    once (NO_SPACE, counted as refused for want of clean room) and drops none of the objects it
    acknowledged (it used to drop them and answer the newest OK)."""
    ssd = SlowSsd(delay_s=0.2)
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager", "put_wait_s": 0}},
                    ssd=ssd).start()
    try:
        keys = [f"k{i}" for i in range(40)]
        t0 = time.monotonic()
        statuses = [s.put([k], [payload(k, CHUNK)])[0] for k in keys]
        assert time.monotonic() - t0 < 2.0  # 40 puts while the SSD takes 0.2 s per batch
        assert statuses.count(Status.OK) + statuses.count(Status.NO_SPACE) == 40
        assert statuses[:8] == [Status.OK] * 8 and Status.NO_SPACE in statuses
        m = s.metrics()["store"]
        assert m["dropped_unpersisted"] == 0 and m["put_room_waits"] == 0
        assert m["put_no_space_dirty"] == m["put_no_space"] == statuses.count(Status.NO_SPACE)
        assert s.flush(timeout_s=30)
        stored = [k for k, st in zip(keys, statuses) if st is Status.OK]
        assert all(read_ok(s, stored))  # every acknowledged object, byte-identical
        assert sorted(ssd.data) == sorted(stored)
    finally:
        s.close()


def test_a_put_waits_for_a_slow_ssd_to_make_room() -> None:
    """put_wait_s longer than an SSD write: each put that finds DRAM full of unwritten objects
    waits for the offload to land one and is stored (woken by the write, not by polling)."""
    ssd = SlowSsd(delay_s=0.05)
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager", "put_wait_s": 10}},
                    ssd=ssd).start()
    try:
        keys = [f"k{i}" for i in range(24)]  # 6 MiB through 2 MiB
        assert [s.put([k], [payload(k, CHUNK)])[0] for k in keys] == [Status.OK] * 24
        m = s.metrics()["store"]
        assert m["put_room_waits"] > 0 and m["put_no_space"] == 0 and m["dropped_unpersisted"] == 0
        assert s.flush(timeout_s=30) and all(read_ok(s, keys))
    finally:
        s.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: an SSD directory whose file system fills up (needs root, as in CI)."""
    import os
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.fail("mounting a small tmpfs needs root (CI runs as root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_disk_loses_nothing(small_disk, backend) -> None:
    """SSD capacity claims 64 MiB but the file system holds 3: writes meet ENOSPC and the backend
    evicts by its own order and writes again (the offset backend, which preallocates, refuses a
    capacity past the file system at open); every acknowledged object stays readable."""
    cfg = {
        "dram": {"capacity_bytes": 16 * MiB},
        "ssd": {"path": str(small_disk / "ssd"), "capacity_bytes": 64 * MiB, "backend": backend,
                "bucket_size_bytes": 1 * MiB, "disk_watermark": 1.0},
        "offload": {"policy": "eager"},
    }
    if backend == "offset":
        with pytest.raises(ConfigError, match="ssd.capacity_bytes=67108864 is larger than the whole file system"):
            TieredStore(cfg)
        cfg["ssd"]["capacity_bytes"] = 2 * MiB
    with TieredStore(cfg) as s:
        keys = [f"k{i}" for i in range(40)]  # 10 MiB
        assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 40
        s.flush(timeout_s=60)
        assert all(read_ok(s, keys))
        m = s.metrics()
        assert m["dram"]["offloads"] > 0
        assert backend == "offset" or m["ssd"]["evictions"] > 0  # room was made on the full disk
        assert m["store"]["dropped_unpersisted"] == 0
        # and the store keeps working: newer objects still go in and come out
        assert s.put(["after"], [payload("after", CHUNK)]) == [Status.OK]
        assert read_ok(s, ["after"]) == [True]


@pytest.mark.parametrize("admission", ["prefix", "all"])
def test_ssd_admission_skips_orphans_and_loses_nothing_else(tmp_path, admission) -> None:
    """ssd.admission_policy "prefix" (the default) keeps chunks whose prefix is stored nowhere off
    SSD; they still serve hits from DRAM and are then dropped as clean, not counted as lost."""
    # LRU, so the filler below pushes the (hit, hence protected under prefix_reuse) orphans out.
    with tiered(tmp_path, "offset", ssd={"admission_policy": admission}, eviction="lru") as s:
        chain = [f"c{i}" for i in range(4)]
        orphans = [f"o{i}" for i in range(4)]
        assert s.put(chain, [payload(k, CHUNK) for k in chain], parents=[None, *chain[:-1]]) == [Status.OK] * 4
        assert s.put(orphans, [payload(k, CHUNK) for k in orphans],
                     parents=["gone", *orphans[:-1]]) == [Status.OK] * 4
        s.flush(timeout_s=30)
        assert all(read_ok(s, orphans))  # still in DRAM
        m = s.metrics()
        declined = 4 if admission == "prefix" else 0
        assert m["store"]["offload_declined"] == declined
        assert m["dram"]["offloads"] == 8 - declined
        filler = [f"f{i}" for i in range(16)]  # 4 MiB more through a 2 MiB DRAM tier
        for k in filler:
            assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
            s.flush(timeout_s=30)
        assert all(read_ok(s, chain))  # from SSD: the chain was admitted either way
        assert s.tier_of(orphans) == ([None] * 4 if admission == "prefix" else ["ssd"] * 4)
        assert s.metrics()["store"]["dropped_unpersisted"] == 0


def test_unknown_admission_policy_is_a_config_error(tmp_path) -> None:
    from store_backend.config import ConfigError
    with pytest.raises(ConfigError, match="admission_policy"):
        tiered(tmp_path, ssd={"admission_policy": "sometimes"})


def test_a_dram_copy_that_outlived_its_ssd_copy_is_written_back_not_dropped(tmp_path) -> None:
    """The SSD tier evicts on its own (the offset backend: oldest first). A chunk kept in DRAM all
    that time is then the only copy; DRAM must write it back before it goes, not drop it as clean."""
    s, ssd = tiered_with_ssd(tmp_path, "offset", ssd={"capacity_bytes": 8 * MiB}, eviction="lru")
    with s:
        s.put(["hot"], [payload("hot", CHUNK)])
        s.flush(timeout_s=30)
        assert ssd.contains(["hot"]) == [True]
        i = 0
        while ssd.contains(["hot"])[0]:  # read all along, so LRU keeps it in DRAM
            assert read_ok(s, ["hot"]) == [True]
            k = f"f{i}"
            s.put([k], [payload(k, CHUNK)])
            settle(s)
            i += 1
            assert i < 200
        assert s.tier_of(["hot"]) == ["dram"]
        for j in range(16):  # DRAM pressure, and "hot" no longer read: it must leave DRAM
            k = f"g{j}"
            s.put([k], [payload(k, CHUNK)])
            settle(s)
        assert s.tier_of(["hot"]) == ["ssd"] and read_ok(s, ["hot"]) == [True]
        assert s.metrics()["store"]["dropped_unpersisted"] == 0


class FlakySsd(SlowSsd):
    """An SSD whose first ``failures`` writes of ``key`` fail with an I/O error (fault injection)."""

    def __init__(self, key: str, failures: int) -> None:
        super().__init__(delay_s=0.0)
        self.key = key
        self.failures = failures

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        out = []
        for k, b in zip(keys, buffers):
            if k == self.key and self.failures > 0:
                self.failures -= 1
                out.append(Status.IO_ERROR)
            else:
                out.extend(super().put([k], [b]))
        return out


@pytest.mark.parametrize("failures,kept", [(1, True), (2, True), (5, False)])
def test_a_failed_offload_is_retried_before_dram_drops_the_object(failures, kept) -> None:
    """A write that failed is tried again when DRAM needs the room (at most MAX_OFFLOAD_ATTEMPTS
    writes in all). An object whose every attempt failed is not retried again; DRAM keeps it while
    clean objects can go instead, so nothing is dropped here."""
    from store_backend.store import MAX_OFFLOAD_ATTEMPTS

    ssd = FlakySsd("k0", failures)
    cfg = {"dram": {"capacity_bytes": 2 * MiB, "eviction_policy": "lru"}, "offload": {"policy": "eager"}}
    with TieredStore(cfg, ssd=ssd) as s:
        assert s.put(["k0"], [payload("k0", CHUNK)]) == [Status.OK]
        settle(s)
        assert "k0" not in ssd.data and s.metrics()["ssd"]["failures"]["io_error"] == 1
        for i in range(1, 24):  # 6 MiB through 2 MiB: every put evicts, k0 first in LRU order
            k = f"k{i}"
            assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
            settle(s)
        m = s.metrics()
        assert ("k0" in ssd.data) is kept
        assert s.tier_of(["k0"]) == (["ssd"] if kept else ["dram"])
        assert m["store"]["dropped_unpersisted"] == 0
        attempts = 1 + m["store"]["offload_retries"]
        assert attempts == (failures + 1 if kept else MAX_OFFLOAD_ATTEMPTS)
        assert m["ssd"]["failures"]["io_error"] == min(failures, MAX_OFFLOAD_ATTEMPTS)
        assert read_ok(s, ["k0"]) == [True]


def test_watermark_demotion_rewrites_a_copy_the_ssd_tier_evicted(tmp_path) -> None:
    """Watermark mode frees DRAM of persisted objects without writing them; one whose SSD copy is
    gone (here removed behind the store's back, as the SSD tier's own eviction would) is written again."""
    s, ssd = tiered_with_ssd(tmp_path, "offset", policy="watermark", eviction="lru",
                             promotion={"admission_hits": 2})
    with s:
        keys = ["hot"] + [f"a{i}" for i in range(7)]
        for k in keys:
            s.put([k], [payload(k, CHUNK)])
        s.flush(timeout_s=30)  # above the high mark: the coldest, "hot" first, move to SSD
        assert s.tier_of(["hot"]) == ["ssd"]
        assert read_ok(s, ["hot"]) == [True] and read_ok(s, ["hot"]) == [True]
        s.flush(timeout_s=30)
        assert s.tier_of(["hot"]) == ["dram"]  # promoted: in DRAM, and persisted
        assert ssd.remove(["hot"]) == [Status.OK]
        for i in range(8):
            k = f"b{i}"
            s.put([k], [payload(k, CHUNK)])
            s.flush(timeout_s=30)
        assert s.tier_of(["hot"]) == ["ssd"] and read_ok(s, ["hot"]) == [True]
        assert s.metrics()["store"]["dropped_unpersisted"] == 0


def test_a_declined_chunk_is_written_once_its_prefix_is_stored_again(tmp_path) -> None:
    """Admission declines a chunk whose parent is stored nowhere. If the parent is put again while
    the chunk is still in DRAM, the chain is whole: DRAM writes the chunk to SSD before it goes."""
    with tiered(tmp_path, "offset", eviction="lru") as s:
        assert s.put(["child"], [payload("child", CHUNK)], parents=["root"]) == [Status.OK]
        s.flush(timeout_s=30)
        assert s.metrics()["store"]["offload_declined"] == 1
        assert s.put(["root"], [payload("root", CHUNK)]) == [Status.OK]  # the prefix is back
        s.flush(timeout_s=30)
        for i in range(12):  # 3 MiB more through a 2 MiB DRAM tier: both leave DRAM
            k = f"f{i}"
            s.put([k], [payload(k, CHUNK)])
            s.flush(timeout_s=30)
        assert s.tier_of(["root", "child"]) == ["ssd", "ssd"]
        assert s.exists(["root", "child"]) == 2 and all(read_ok(s, ["root", "child"]))
        assert s.metrics()["store"]["dropped_unpersisted"] == 0


class BlockingSsd(SlowSsd):
    """Fault injection: every put blocks until the test opens the gate (a stalled SSD)."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.0)
        self.entered = threading.Event()
        self.release = threading.Event()

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        self.entered.set()
        assert self.release.wait(30)
        return super().put(keys, buffers)


def test_a_stalled_ssd_write_never_holds_all_of_dram() -> None:
    """One SSD write leases at most half of DRAM (before, a batch could lease every object). What
    it does not lease is not on SSD either, so a put that needs room meanwhile drops none of it
    (it used to drop one): refused at once without a wait, stored once the write lands with one."""
    ssd = BlockingSsd()
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager", "put_wait_s": 0}},
                    ssd=ssd)  # not started: only the writer below writes
    try:
        keys = [f"k{i}" for i in range(8)]  # DRAM full
        assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 8
        writer = threading.Thread(target=s._offload_batch, args=(keys,))
        writer.start()
        assert ssd.entered.wait(10)
        assert leased_dram_bytes(s) <= MiB
        assert s.put(["new"], [payload("new", CHUNK)]) == [Status.NO_SPACE]
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(s.reserve(["new"], [CHUNK], room_wait_s=30)))
        waiter.start()
        time.sleep(0.2)  # the window in which the reserve must not return
        assert waiter.is_alive()
        ssd.release.set()  # the write lands: its objects are clean, one of them makes room
        waiter.join(10)
        assert [r.status for r in got] == [Status.OK]
        s.abort(got)
        m = s.metrics()["store"]
        assert m["dropped_unpersisted"] == 0 and m["put_no_space_dirty"] == 1 and m["put_room_waits"] == 1
    finally:
        ssd.release.set()
        writer.join(10)
        s.close(flush=False)


def test_close_ends_a_put_waiting_for_room() -> None:
    """A put waiting for DRAM room (an SSD write that never ends) is woken by close(): it answers
    NO_SPACE, and close is not held up by it."""
    ssd = BlockingSsd()
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager", "put_wait_s": 60}},
                    ssd=ssd).start()
    keys = [f"k{i}" for i in range(8)]
    assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 8  # DRAM full, nothing written
    assert ssd.entered.wait(10)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(s.put(["late"], [payload("late", CHUNK)])))
    waiter.start()
    time.sleep(0.2)  # the window in which the put must not return
    assert waiter.is_alive()
    t0 = time.monotonic()
    closer = threading.Thread(target=s.close, kwargs={"flush": False, "timeout_s": 5})
    closer.start()
    waiter.join(5)
    assert not waiter.is_alive() and got == [[Status.NO_SPACE]] and time.monotonic() - t0 < 2.0
    ssd.release.set()
    closer.join(10)
    assert not closer.is_alive()


def test_a_put_against_a_stalled_ssd_answers_no_space_once_put_wait_s_has_passed() -> None:
    """put_wait_s bounds the wait: with the SSD stalled (its write never lands), a put that finds
    DRAM full of unwritten objects waits about put_wait_s for room, then answers NO_SPACE; nothing
    acknowledged is dropped, and once the SSD comes back everything acknowledged reaches it."""
    ssd = BlockingSsd()
    wait_s = 0.4
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB}, "offload": {"policy": "eager", "put_wait_s": wait_s}},
                    ssd=ssd).start()
    try:
        keys = [f"k{i}" for i in range(8)]  # DRAM full, every object's write owed
        assert s.put(keys, [payload(k, CHUNK) for k in keys]) == [Status.OK] * 8
        assert ssd.entered.wait(10)  # the offload's first write hangs in the SSD
        t0 = time.monotonic()
        assert s.put(["new"], [payload("new", CHUNK)]) == [Status.NO_SPACE]
        waited = time.monotonic() - t0
        assert wait_s * 0.9 <= waited < wait_s + 2.0, waited
        m = s.metrics()["store"]
        assert m["put_room_waits"] == 1 and m["put_no_space_dirty"] == 1 and m["dropped_unpersisted"] == 0
        ssd.release.set()
        assert s.flush(timeout_s=30) and all(read_ok(s, keys)) and sorted(ssd.data) == sorted(keys)
    finally:
        ssd.release.set()
        s.close(flush=False)
