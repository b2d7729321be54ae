"""The store's residency events and its reaction to evictions inside the SSD tier.

- every change of residency is published: stored, moved (offload, promotion), evicted (DRAM for
  room; the SSD backend's own eviction), removed;
- an eviction inside any SSD backend makes the DRAM copy dirty again (so DRAM writes it back
  before it may drop it) and publishes ``evicted`` for the SSD tier;
- the race the EvictionClock closes: an offload's put lands k, another write evicts k and its
  report is handled before the offload commits: k stays dirty, never a dropped last copy.
"""

from __future__ import annotations

import threading

import pytest

from store_backend.config import load_config
from store_backend.residency import ResidencyEvent
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload
from tests.support.store_views import dram_entry

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
CHUNK = 256 * 1024


class Recorder:
    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.events: list[ResidencyEvent] = []
        self.gaps = 0
        store.subscribe(self.events.extend, on_gap=self._gap)

    def _gap(self) -> None:
        self.gaps += 1

    def seen(self) -> list[tuple[str, str, str]]:
        assert self.store.wait_idle(10, offload=False, promotion=False)
        return [(e.kind, e.key, e.tier) for e in self.events]


def config(tmp_path, backend: str = "bucket", *, dram: int = 2 * MiB, ssd_bytes: int = 64 * MiB,
           **offload) -> dict:
    return {"dram": {"capacity_bytes": dram, "eviction_policy": "lru"},
            "ssd": {"path": str(tmp_path / "ssd"), "backend": backend, "capacity_bytes": ssd_bytes,
                    "bucket_size_bytes": 256 * 1024, "bucket_max_keys": 4},
            "offload": {"policy": "eager", **offload},
            "promotion": {"admission_hits": 1}}


def test_stored_moved_evicted_promoted_removed(tmp_path) -> None:
    with TieredStore(config(tmp_path)) as s:
        rec = Recorder(s)
        keys = [f"k{i}" for i in range(12)]  # 3 MiB through 2 MiB of DRAM
        for k in keys:
            assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
            assert s.flush(timeout_s=30)
        seen = rec.seen()
        assert [x for x in seen if x[0] == "stored"] == [("stored", k, "dram") for k in keys]
        assert [x for x in seen if x[0] == "moved"] == [("moved", k, "ssd") for k in keys]
        dropped = [x[1] for x in seen if x[0] == "evicted"]
        assert dropped and all(x[2] == "dram" for x in seen if x[0] == "evicted")
        assert not any(e.lost for e in rec.events)  # everything reached SSD before DRAM let go
        moved = {e.key: e for e in rec.events if e.kind == "moved"}
        assert moved["k0"].src_tier == "dram" and moved["k0"].size == CHUNK
        for k in dropped:  # each one left DRAM after its copy landed
            assert seen.index(("moved", k, "ssd")) < seen.index(("evicted", k, "dram"))
        # A read from SSD promotes it (admission_hits 1): moved back into DRAM.
        assert s.tier_of(["k0"]) == ["ssd"]
        buf = bytearray(CHUNK)
        assert s.get_into(["k0"], [buf])[0].status is Status.OK
        assert s.wait_idle(10, offload=False, events=False)
        assert ("moved", "k0", "dram") in rec.seen()
        assert s.remove(["k0", "k1", "nope"]) == [Status.OK, Status.OK, Status.NOT_FOUND]
        tail = rec.seen()[-2:]
        assert tail == [("removed", "k0", "*"), ("removed", "k1", "*")]
        assert [e.seq for e in rec.events] == sorted(e.seq for e in rec.events)
        assert len({e.seq for e in rec.events}) == len(rec.events)
        assert rec.gaps == 0 and s.metrics()["store"]["events_dropped"] == 0


def test_without_ssd_a_dram_eviction_is_the_last_copy(tmp_path) -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 * MiB}}) as s:
        rec = Recorder(s)
        for i in range(6):
            assert s.put([f"k{i}"], [payload(f"k{i}", CHUNK)]) == [Status.OK]
        rec.seen()
        lost = [e for e in rec.events if e.kind == "evicted"]
        assert lost and all(e.lost and e.tier == "dram" for e in lost)


def _ssd_evicts_the_first_key(s: TieredStore, n: int = 40) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    for k in keys:
        assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
        assert s.wait_idle(30, promotion=False, events=False)  # not flush: it would write the evicted copies back
    return keys


@pytest.mark.parametrize("backend", ["bucket", "offset", "file"])
def test_an_eviction_inside_the_ssd_backend_makes_the_dram_copy_dirty_again(tmp_path, backend) -> None:
    """16 MiB of DRAM keeps all 40 objects (10 MiB); 4 MiB of SSD cannot: the backend evicts the
    oldest. Each DRAM copy it evicted is dirty again (not persisted), and ``evicted`` is published
    for the SSD tier, not as lost (DRAM still has it)."""
    c = load_config(config(tmp_path, backend, dram=16 * MiB, ssd_bytes=4 * MiB))
    assert c.ssd is not None
    ssd = open_ssd_backend(c.ssd)
    with TieredStore(c, ssd=ssd) as s:
        rec = Recorder(s)
        _ssd_evicts_the_first_key(s)
        assert ssd.contains(["k0"]) == [False]
        rec.seen()
        ssd_evicted = [e for e in rec.events if e.kind == "evicted" and e.tier == "ssd"]
        assert "k0" in {e.key for e in ssd_evicted}
        assert not any(e.lost for e in ssd_evicted)
        # What the SSD tier lost and DRAM still holds is dirty; what the SSD tier holds is clean.
        for key, e in s.dram_snapshot().entries.items():
            assert e.persisted == ssd.contains([key])[0], key
        # And it is written back when asked, not dropped: the bytes stay readable.
        buf = bytearray(CHUNK)
        assert s.get_into(["k0"], [buf])[0].status is Status.OK and bytes(buf) == payload("k0", CHUNK).tobytes()


class EvictsAfterLanding:
    """Fault injection around a real backend: right after the offload's put of ``key`` returns OK
    (before the store commits it), a second put, run in another thread, "evicts" it: the copy is
    deleted and the eviction is reported to the store's listener, as a backend does."""

    def __init__(self, inner, key: str) -> None:  # noqa: ANN001
        self.inner, self.name, self.key = inner, inner.name, key
        self.listener = None
        self.done = threading.Event()

    def set_eviction_listener(self, fn) -> None:  # noqa: ANN001
        self.listener = fn
        self.inner.set_eviction_listener(fn)

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        out = self.inner.put(keys, buffers)
        if self.key in keys and not self.done.is_set():
            def other_put() -> None:
                assert self.inner.remove([self.key]) == [Status.OK]
                self.listener([self.key])

            t = threading.Thread(target=other_put, name="other-put")
            t.start()
            t.join(10)
            self.done.set()
        return out

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_an_eviction_reported_before_the_offload_commits_leaves_the_key_dirty(tmp_path) -> None:
    c = load_config(config(tmp_path, dram=4 * MiB))
    assert c.ssd is not None
    ssd = EvictsAfterLanding(open_ssd_backend(c.ssd), "k")
    with TieredStore(c, ssd=ssd) as s:
        assert s.put(["k"], [payload("k", CHUNK)]) == [Status.OK]
        assert ssd.done.wait(10)
        assert s.wait_idle(10, promotion=False, events=False)
        e = dram_entry(s, "k")
        assert ssd.inner.contains(["k"]) == [False]
        assert not e.persisted, "marked persisted although its only SSD copy was evicted"
        # DRAM pressure: "k" is written back before it goes, never dropped as the last copy.
        for i in range(24):
            assert s.put([f"f{i}"], [payload(f"f{i}", CHUNK)]) == [Status.OK]
            s.flush(timeout_s=30)
        assert s.metrics()["store"]["dropped_unpersisted"] == 0
        assert ssd.inner.contains(["k"]) == [True]
        buf = bytearray(CHUNK)
        assert s.get_into(["k"], [buf])[0].status is Status.OK and bytes(buf) == payload("k", CHUNK).tobytes()
