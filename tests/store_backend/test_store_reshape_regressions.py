"""Regressions of the store reshape (residency events, eviction listeners, victim verdicts that
trust ``entry.persisted``): each case once lost a DRAM copy, a hit, or a served read."""

from __future__ import annotations

import threading

import pytest

from store_backend.config import load_config
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload
from tests.support.store_views import dram_entry

MiB = 1 << 20
CHUNK = 256 * 1024


def _watch_index_drops(backend, key, on_drop):
    """Call ``on_drop()`` in the evicting thread right after ``backend`` takes ``key`` out of its
    index and its eviction listener (the store's) heard of it, the backend's lock still held: what
    a reader of the index sees from then on. Call before the store is opened on ``backend`` (the
    store sets its listener at open)."""
    listen = backend.set_eviction_listener

    def set_listener(fn):
        def heard(keys):
            if fn is not None:
                fn(keys)
            if key in keys:
                on_drop()
        listen(heard)
    backend.set_eviction_listener = set_listener


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["bucket", "offset", "file"])
def test_dram_copy_is_dirty_once_the_backend_drops_the_key(tmp_path, backend):
    """The DRAM copy of a key the SSD backend just evicted is dirty before any reader can miss the
    key below (once it read persisted=True until the end of the evicting put, after its I/O, and
    DRAM pressure in that window dropped the last copy)."""
    cfg = {"dram": {"capacity_bytes": 4 * MiB, "eviction_policy": "lru"},
           "ssd": {"path": str(tmp_path / "ssd"), "backend": backend, "capacity_bytes": 2 * MiB,
                   "bucket_size_bytes": 256 * 1024, "bucket_max_keys": 4},
           "offload": {"policy": "eager"}, "promotion": {"enabled": False}}
    c = load_config(cfg)
    ssd = open_ssd_backend(c.ssd)
    seen: list[bool] = []
    dropped = threading.Event()
    box: list = [None]

    def on_drop():
        e = dram_entry(box[0], "k0")
        seen.append(e is not None and e.persisted)
        dropped.set()
    _watch_index_drops(ssd, "k0", on_drop)
    with TieredStore(c, ssd=ssd) as s:
        box[0] = s
        assert s.put(["k0"], [payload("k0", CHUNK)]) == [Status.OK]
        assert s.flush(timeout_s=30)
        assert dram_entry(s, "k0").persisted
        assert not dropped.is_set()
        i = 0
        while not dropped.is_set() and i < 40:  # offload of f* fills the 2 MiB SSD: k0 evicted
            assert s.put([f"f{i}"], [payload(f"f{i}", CHUNK)]) == [Status.OK]
            i += 1
            dropped.wait(0.2)
        assert dropped.is_set(), "backend never evicted k0"
        assert seen == [False], "k0 left the SSD index while its DRAM copy still read persisted"
        assert s.wait_idle(30)
        assert s.get_into(["k0"], [bytearray(CHUNK)])[0].status is Status.OK


class _OtherWriterEvicts:
    """Right after the store's put of ``key`` returns, another writer's put (another thread) evicts
    it; that writer holds its put, right after the index drop, until the store's offload is idle
    and the test has looked at the store (``checked``)."""

    def __init__(self, inner, key, store_box):
        self.inner, self.name, self.key, self.fired = inner, inner.name, key, False
        self.noted, self.checked = threading.Event(), threading.Event()
        self._box = store_box

        def on_drop():
            if threading.current_thread().name == "other-writer":
                self.noted.set()
                self._box[0].wait_idle(5, promotion=False, events=False)  # the offload commits inside the window
                self.checked.wait(10)
        _watch_index_drops(inner, key, on_drop)

    def put(self, keys, buffers):
        out = self.inner.put(keys, buffers)
        if self.key in keys and not self.fired:
            self.fired = True

            def other():
                for i in range(12):
                    if self.noted.is_set():
                        break
                    self.inner.put([f"o{i}"], [payload(f"o{i}", CHUNK)])
            threading.Thread(target=other, name="other-writer", daemon=True).start()
            assert self.noted.wait(10), "other writer never evicted the key"
        return out

    def __getattr__(self, n):
        return getattr(self.inner, n)


@pytest.mark.timeout(60)
def test_offload_commit_sees_an_eviction_not_yet_finished(tmp_path):
    """An offload's put of k returns; another writer's put evicts k and is still running when the
    offload commits: the EvictionClock already has the stamp, so k stays dirty and is not lost."""
    c = load_config({"dram": {"capacity_bytes": 4 * MiB, "eviction_policy": "lru"},
                     "ssd": {"path": str(tmp_path / "ssd"), "backend": "offset", "capacity_bytes": 2 * MiB},
                     "offload": {"policy": "eager"}, "promotion": {"enabled": False}})
    box: list = [None]
    ssd = _OtherWriterEvicts(open_ssd_backend(c.ssd), "k", box)
    s = TieredStore(c, ssd=ssd)
    box[0] = s
    with s:
        assert s.put(["k"], [payload("k", CHUNK)]) == [Status.OK]
        assert ssd.noted.wait(10)
        assert s.wait_idle(10)
        # The other writer's put is still held inside its eviction of k (nothing asks the backend
        # here: its lock may be held): the offload's commit must not have called k persisted.
        persisted = dram_entry(s, "k").persisted
        ssd.checked.set()
        assert not persisted, "k marked persisted after the SSD tier evicted it"
        for j in range(20):  # DRAM pressure, each put's offload done: clean victims come first
            s.put([f"g{j}"], [payload(f"g{j}", CHUNK)])
            assert s.wait_idle(10)
            if dram_entry(s, "k") is None:
                break
        assert s.wait_idle(30)
        assert s.get_into(["k"], [bytearray(CHUNK)])[0].status is Status.OK
        assert s.metrics()["store"]["dropped_unpersisted"] == 0


def _known_below_cfg(tmp_path):
    return {"dram": {"capacity_bytes": 2 * MiB},
            "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "admission_policy": "reused"},
            "offload": {"policy": "eager"}, "promotion": {"enabled": False}}


def _known_below_store(tmp_path, forget: str | None = None) -> tuple[TieredStore, object]:
    """A store over an SSD backend the test holds; with ``forget``, the store's seed of what is
    stored below (its first ``keys()``, at open) leaves that key out, as if the bounded seed had
    forgotten it."""
    c = load_config(_known_below_cfg(tmp_path))
    ssd = open_ssd_backend(c.ssd)
    return TieredStore(c, ssd=ssd if forget is None else _ForgetsAtOpen(ssd, forget)), ssd


class _ForgetsAtOpen:
    """An SSD backend whose first ``keys()`` leaves ``key`` out; everything else is the inner one's."""

    def __init__(self, inner, key):
        self.inner, self.key, self.asked = inner, key, False

    def keys(self):
        keys = list(self.inner.keys())
        if not self.asked:
            self.asked = True
            keys = [k for k in keys if k != self.key]
        return keys

    def __getattr__(self, n):
        return getattr(self.inner, n)


def _declined_child_is_written_back(s, ssd) -> None:
    """Put child C of parent P (P below, not in DRAM) and reuse C so that admission wants it: DRAM
    eviction's verdict on C is to write it back, not to drop it (a parent wrongly taken as not
    stored made it EVICT: the reused child was dropped, never written)."""
    assert dram_entry(s, "P") is None
    assert s.put(["C"], [payload("C", CHUNK)], parents=["P"]) == [Status.OK]
    assert s.wait_idle(10)
    assert dram_entry(s, "C").declined  # used once so far: admission declined its first write
    assert ssd.contains(["C"]) == [False]
    for _ in range(3):  # C is reused: admission would write it now
        assert s.get_into(["C"], [bytearray(CHUNK)])[0].status is Status.OK
    # DRAM pressure (2 MiB) from fillers reused more than C pushes C out: written back first, so
    # it is still served (from SSD) once it left DRAM.
    i = 0
    while dram_entry(s, "C") is not None and i < 64:
        assert s.put([f"fill{i}"], [payload(f"fill{i}", CHUNK)]) == [Status.OK]
        for _ in range(6):
            s.get_into([f"fill{i}"], [bytearray(CHUNK)])
        assert s.wait_idle(10)
        i += 1
    assert dram_entry(s, "C") is None, "DRAM pressure never evicted C"
    assert ssd.contains(["C"]) == [True], "reused child of a stored parent was dropped, never written"
    buf = bytearray(CHUNK)
    assert s.get_into(["C"], [buf])[0].status is Status.OK and bytes(buf) == payload("C", CHUNK).tobytes()
    assert s.metrics()["store"]["dropped_unpersisted"] == 0


def _parent_on_ssd(tmp_path) -> None:
    s, ssd = _known_below_store(tmp_path)
    with s:  # P used twice so that 'reused' admits it
        assert s.put(["P"], [payload("P", CHUNK)]) == [Status.OK]
        s.get_into(["P"], [bytearray(CHUNK)])
        s.get_into(["P"], [bytearray(CHUNK)])
        assert s.flush(timeout_s=30)
        assert ssd.contains(["P"]) == [True]


@pytest.mark.timeout(60)
def test_declined_child_of_recovered_parent_is_written_back(tmp_path):
    """A parent recovered from an earlier run counts as stored (KnownBelow is seeded at open)."""
    _parent_on_ssd(tmp_path)
    s, ssd = _known_below_store(tmp_path)
    with s:
        assert s.tier_of(["P"]) == ["ssd"]
        _declined_child_is_written_back(s, ssd)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["put_exists", "read"])
def test_parent_seen_below_counts_as_stored(tmp_path, how):
    """A parent a put found below (EXISTS) or a read was served from below counts as stored,
    though KnownBelow was not seeded with it (the store's seed at open did not list it)."""
    _parent_on_ssd(tmp_path)
    s, ssd = _known_below_store(tmp_path, forget="P")
    with s:
        if how == "put_exists":
            assert s.put(["P"], [payload("P", CHUNK)]) == [Status.EXISTS]
        else:
            assert s.get_into(["P"], [bytearray(CHUNK)])[0].status is Status.OK
        _declined_child_is_written_back(s, ssd)


@pytest.mark.timeout(60)
def test_a_tier_that_raises_fails_only_its_own_keys(tmp_path):
    """A lower tier whose get_into raises (a broken pool) answers IO_ERROR for the keys it was
    asked, counted as its failures; hits already served (DRAM) stand, and a tier below a broken one
    is still asked."""
    from tests.store_backend.test_tiers import two_tiers_and_ssd

    s, pool, ssd = two_tiers_and_ssd(tmp_path)
    with s:
        assert s.put(["d"], [payload("d", CHUNK)]) == [Status.OK] and s.flush(timeout_s=30)

        def boom(keys, buffers=None):
            raise ConnectionError("pool down")
        pool.get_into = boom
        bufs = [bytearray(CHUNK), bytearray(CHUNK)]
        res = s.get_into(["d", "missing"], bufs)
        assert [r.status for r in res] == [Status.OK, Status.IO_ERROR]
        assert bytes(bufs[0]) == payload("d", CHUNK).tobytes()
        assert s.metrics_counters.tier("pool").failures.io_error == 1
        # The SSD tier broken, the pool below it serves.
        del pool.get_into
        pool.data["p"] = payload("p", CHUNK).tobytes()
        ssd.get_into = boom
        buf = bytearray(CHUNK)
        assert s.get_into(["p"], [buf])[0].status is Status.OK and bytes(buf) == payload("p", CHUNK).tobytes()
        assert s.metrics_counters.tier("ssd").failures.io_error == 1


@pytest.mark.timeout(60)
def test_close_flushes_to_a_backing_tier_that_is_not_an_ssd_backend(tmp_path):
    """close(flush=True) writes dirty objects to the backing tier, whatever tier that is (it once
    flushed only when an SSD backend was underneath)."""
    from store_backend.tiers.base import TierTraits
    from tests.store_backend.test_tiers import DictTier

    class BackingDict(DictTier):
        name = "backing"
        traits = TierTraits(backs_dram=True, durable=True, exclusive=True, local_index=True)

    tier = BackingDict()
    c = load_config({"dram": {"capacity_bytes": 4 * MiB}, "offload": {"policy": "watermark"}})
    s = TieredStore(c, tiers=[tier]).start()
    assert s.config.ssd is None  # the tier is the only one below, so the backing one
    assert s.put(["w"], [payload("w", CHUNK)]) == [Status.OK]  # far below the high watermark: dirty
    s.close(flush=True, timeout_s=30)
    assert tier.data.get("w") == payload("w", CHUNK).tobytes(), "close did not flush to the backing tier"
