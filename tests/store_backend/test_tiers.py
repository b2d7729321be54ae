"""The Tier seam below DRAM: SsdTier over every backend, and a store over two tiers (SSD, then a
dict-backed tier standing in for a pool) that reads in order, removes from both and hides a key
across both."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from store_backend.config import SsdConfig, load_config
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.tiers.base import Tier, TierGauges, TierTraits
from store_backend.tiers.ssd import SsdTier
from store_backend.types import Buffer, ReadResult, Status, byte_view
from tests.store_backend.conftest import payload
from tests.support.store_views import dram_entry

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
CHUNK = 64 * 1024


@pytest.mark.parametrize("backend", ["bucket", "offset", "file"])
def test_ssd_tier_adapts_every_backend(tmp_path, backend) -> None:
    b = open_ssd_backend(SsdConfig(path=str(tmp_path / "ssd"), backend=backend, capacity_bytes=8 * MiB))
    t = SsdTier(b)
    try:
        assert isinstance(t, Tier) and t.name == "ssd"
        assert t.traits == TierTraits(backs_dram=True, durable=True, exclusive=True, local_index=True)
        assert t.put(["a"], [payload("a", 1000)]) == [Status.OK]
        assert t.contains(["a", "b"]) == [True, False] and t.size_of(["a"]) == [1000]
        buf = bytearray(1000)
        assert t.get_into(["a"], [buf])[0].status is Status.OK and bytes(buf) == payload("a", 1000).tobytes()
        assert list(t.keys()) == ["a"]
        st = b.stats()
        assert t.gauges() == TierGauges(objects=1, used_bytes=st.used_bytes, capacity_bytes=st.capacity_bytes,
                                        evictions=0)
        assert t.extra_stats() == {"corrupt_reads": 0, "recovered_objects": 0}
        assert t.remove(["a"]) == [Status.OK] and t.contains(["a"]) == [False]
    finally:
        t.close()


class DictTier:
    """A tier that does not back DRAM and answers lookups remotely (a pool's traits), in a dict."""

    name = "pool"
    traits = TierTraits(backs_dram=False, durable=False, exclusive=False, local_index=False)

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.fail_removes = False
        self.calls: list[str] = []

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        with self.lock:
            self.calls.append("put")
            for k, b in zip(keys, buffers):
                self.data[k] = bytes(byte_view(b))
        return [Status.OK] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        out = []
        with self.lock:
            self.calls.append("get_into")
            for k, b in zip(keys, buffers):
                v = self.data.get(k)
                dst = byte_view(b)
                if v is None:
                    out.append(ReadResult(Status.NOT_FOUND))
                elif dst.nbytes < len(v):
                    out.append(ReadResult(Status.BUFFER_TOO_SMALL))
                else:
                    dst[:len(v)] = v
                    out.append(ReadResult(Status.OK, len(v)))
        return out

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self.lock:
            self.calls.append("contains")
            return [k in self.data for k in keys]

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        with self.lock:
            return [len(self.data[k]) if k in self.data else None for k in keys]

    def remove(self, keys: Sequence[str]) -> list[Status]:
        with self.lock:
            if self.fail_removes:
                return [Status.IO_ERROR] * len(keys)
            return [Status.OK if self.data.pop(k, None) is not None else Status.NOT_FOUND for k in keys]

    def keys(self) -> Iterator[str]:
        with self.lock:
            return iter(list(self.data))

    def gauges(self) -> TierGauges:
        return TierGauges(objects=len(self.data))

    def extra_stats(self) -> dict[str, int]:
        return {}

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None:
        pass

    def close(self) -> None:
        pass


def two_tiers(tmp_path) -> tuple[TieredStore, DictTier]:
    s, pool, _ssd = two_tiers_and_ssd(tmp_path)
    return s, pool


def two_tiers_and_ssd(tmp_path) -> tuple[TieredStore, DictTier, SsdBackend]:
    """A started store over SSD then a DictTier pool; and the SSD backend (the store owns it)."""
    cfg = load_config({"dram": {"capacity_bytes": 1 * MiB}, "offload": {"policy": "eager"},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 16 * MiB,
                               "admission_policy": "all"},
                       "promotion": {"admission_hits": 1}})
    assert cfg.ssd is not None
    pool = DictTier()
    ssd = open_ssd_backend(cfg.ssd)
    store = TieredStore(cfg, ssd=ssd, tiers=[pool])
    return store.start(), pool, ssd


def test_reads_fall_through_the_tiers_in_order(tmp_path) -> None:
    s, pool, ssd = two_tiers_and_ssd(tmp_path)
    with s:
        pool.data["p"] = payload("p", CHUNK).tobytes()
        assert s.put(["d"], [payload("d", CHUNK)]) == [Status.OK] and s.flush(timeout_s=30)
        assert ssd.contains(["d"]) == [True] and "d" not in pool.data  # the pool never backs DRAM
        assert s.tier_of(["d", "p", "nope"]) == ["dram", "pool", None]
        assert s.contains(["p"]) == [True] and s.size_of(["p"]) == [CHUNK] and s.exists(["d", "p"]) == 2
        # keys() lists this node's own tiers only, and tier_of(local_only) asks them alone.
        assert sorted(s.keys()) == ["d"] and s.tier_of(["p"], local_only=True) == [None]
        buf = bytearray(CHUNK)
        assert s.get_into(["p"], [buf])[0].status is Status.OK and bytes(buf) == payload("p", CHUNK).tobytes()
        m = s.metrics_counters
        assert m.tier("pool").hits == 1 and m.ssd.misses >= 1  # SSD asked first, then the pool
        # Kept from the pool at once as a local replica: not persisted (no SSD copy), but clean
        # (another node holds it), so eviction may drop it and no flush writes it.
        e = dram_entry(s, "p")
        assert e is not None and e.ready and not e.persisted and e.replica and e.clean
        assert s.tier_of(["p"], local_only=True) == ["dram"] and s.flush_report(timeout_s=30).ok
        # put's EXISTS check skips a tier without a local index: a key only in the pool is stored.
        pool.data["q"] = b"x"
        assert s.put(["q"], [payload("q", CHUNK)]) == [Status.OK]
        # Stats keep their fixed shape (the pool's field is always there).
        assert set(s.metrics()) == {"dram", "ssd", "pool", "store", "queues", "latency", "slots"}


class OversizedAnswers(DictTier):
    """Fault injection: a pool tier that breaks the Tier contract by answering OK with more bytes
    than the caller's buffer holds (it wrote only what fits)."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        out = super().get_into(keys, buffers)
        return [ReadResult(Status.OK, byte_view(b).nbytes + 4096) if r.ok else r for r, b in zip(out, buffers)]


def test_a_pool_answer_longer_than_its_buffer_is_never_kept_as_a_replica(tmp_path) -> None:
    """A replica is kept only when the caller's buffer holds the whole object: a copy shorter than
    the object would commit the slot's previous bytes as the object's tail."""
    pool = OversizedAnswers()
    s = TieredStore({"dram": {"capacity_bytes": 4 << 20}}, tiers=[pool]).start()
    with s:
        pool.data["p"] = payload("p", CHUNK).tobytes()
        buf = bytearray(CHUNK)
        assert s.get_into(["p"], [buf])[0].status is Status.OK
        assert s.wait_idle(10)
        assert dram_entry(s, "p") is None and s.tier_of(["p"], local_only=True) == [None]


def test_remove_is_ok_only_when_every_tier_deleted_and_a_pool_failure_is_the_pools_to_retry(tmp_path) -> None:
    s, pool, ssd = two_tiers_and_ssd(tmp_path)
    with s:
        assert s.put(["k"], [payload("k", CHUNK)]) == [Status.OK] and s.flush(timeout_s=30)
        pool.data["k"] = payload("k", CHUNK).tobytes()
        assert s.remove(["k"]) == [Status.OK]
        assert "k" not in pool.data and ssd.contains(["k"]) == [False] and s.contains(["k"]) == [False]
        # A pool that cannot delete (a node of it did not confirm): IO_ERROR, this node's SSD copy
        # went, the pool's stayed. The key is not hidden here for the pool's failure (the pool
        # retries it itself): once the pool's copy is gone, a put of the key is stored, persisted
        # and read back, and its offload does not ask the pool to remove the key again.
        assert s.put(["j"], [payload("j", CHUNK)]) == [Status.OK] and s.flush(timeout_s=30)
        pool.data["j"] = payload("j", CHUNK).tobytes()
        pool.fail_removes = True
        assert s.remove(["j"]) == [Status.IO_ERROR]
        assert ssd.contains(["j"]) == [False] and "j" in pool.data
        assert s.tier_of(["j"]) == ["pool"]
        del pool.data["j"]  # the pool's own retry got through (its removes still fail: fail_removes)
        fresh = payload("j-v2", CHUNK)
        assert s.put(["j"], [fresh]) == [Status.OK] and s.flush(timeout_s=30)
        assert ssd.contains(["j"]) == [True] and s.tier_of(["j"], local_only=True) == ["dram"]
        buf = bytearray(CHUNK)
        assert s.get_into(["j"], [buf])[0].status is Status.OK and bytes(buf) == fresh.tobytes()
