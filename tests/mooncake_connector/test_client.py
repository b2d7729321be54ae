"""KVClient over a real TieredStore: async batched save/load, per-key results, leases, bounds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from mooncake_connector.client import ClientClosedError, CopiedLease, KVClient, KVStore
from mooncake_connector.config import load_connector_config
from mooncake_connector.stores import acquire_store, release_store
from store_backend.store import TieredStore
from store_backend.types import Buffer, Status

SIZE = 64 * 1024


def obj(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with TieredStore({"dram": {"capacity_bytes": 8 * SIZE}, "ssd": {"path": str(tmp_path / "ssd")}}) as s:
        yield s


def test_store_satisfies_the_protocol(store: TieredStore) -> None:
    assert isinstance(store, KVStore)


def test_save_then_load_round_trip_with_per_key_results(store: TieredStore) -> None:
    with KVClient(store, io_workers=2) as client:
        keys = [f"fp/{i}" for i in range(4)]
        assert client.save(keys, [obj(i) for i in range(4)]).result(10) == [Status.OK] * 4
        assert client.save(keys[:1], [obj(0)]).result(10) == [Status.EXISTS]
        assert client.lookup(keys + ["fp/missing", "fp/3"]) == 4
        outs = [np.zeros(SIZE, np.uint8) for _ in range(5)]
        res = client.load(keys + ["fp/missing"], outs).result(10)
        assert [r.status for r in res] == [Status.OK] * 4 + [Status.NOT_FOUND]
        for i in range(4):
            assert np.array_equal(outs[i], obj(i))
        stats = client.stats()
    assert stats["saved_objects"] == 4 and stats["save_exists"] == 1
    assert stats["loaded_objects"] == 4 and stats["load_failed"] == 1


def test_a_stored_object_of_the_wrong_size_is_never_used(store: TieredStore) -> None:
    with KVClient(store) as client:
        client.save(["k"], [obj(1)[: SIZE // 2]]).result(10)
        res = client.load(["k"], [np.zeros(SIZE, np.uint8)], sizes=[SIZE]).result(10)
    assert res[0].status is Status.CORRUPT


def test_lookup_all_needs_every_shard(store: TieredStore) -> None:
    with KVClient(store) as client:
        client.save(["s0/a", "s0/b", "s1/a"], [obj(1), obj(2), obj(3)]).result(10)
        assert client.lookup_all_async([["s0/a", "s0/b"], ["s1/a", "s1/b"]]).result(10) == 1
        assert client.lookup_all([["s0/a", "s0/b"]]) == 2


def test_leases_keep_objects_until_unpinned(store: TieredStore) -> None:
    with KVClient(store, lease_ttl_s=60) as client:
        client.save(["pinned"], [obj(7)]).result(10)
        assert client.pin(["pinned", "absent"]) == [True, False]
        # Fill DRAM far past its capacity: the leased object must survive eviction.
        for i in range(20):
            client.save([f"filler/{i}"], [obj(100 + i)]).result(10)
        out = np.zeros(SIZE, np.uint8)
        assert client.load(["pinned"], [out], unpin_after=True).result(10)[0].ok
        assert np.array_equal(out, obj(7))


class _BlockingStore:
    """Fault injection: a store whose puts hang until released (an SSD that fell far behind)."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer], parents=None) -> list[Status]:
        self.gate.wait(10)
        return self.inner.put(keys, buffers, parents)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_saves_never_block_the_caller_and_excess_saves_are_dropped(store: TieredStore) -> None:
    slow = _BlockingStore(store)
    client = KVClient(slow, io_workers=1, max_pending_batches=2).start()
    try:
        first = [client.save([f"d/{i}"], [obj(i)]) for i in range(2)]
        dropped = client.save(["d/9"], [obj(9)])
        assert dropped.done() and dropped.result() == [Status.NO_SPACE]
        assert client.stats()["saves_dropped"] == 1
        slow.gate.set()
        assert [f.result(10) for f in first] == [[Status.OK], [Status.OK]]
    finally:
        slow.gate.set()
        client.close()
    with pytest.raises(ClientClosedError):
        client.save(["late"], [obj(1)])


def test_one_store_per_config_per_process(tmp_path: Path) -> None:
    cfg = load_connector_config({"store": {"dram": {"capacity_bytes": "1MiB"},
                                           "ssd": {"path": str(tmp_path / "ssd")}}}).store_config()
    a = acquire_store(cfg)
    b = acquire_store(cfg)
    assert a is b
    a.put(["x"], [obj(1)])
    release_store(a)
    assert b.contains(["x"]) == [True]  # still open: one holder left
    release_store(b)  # last holder: flushed to SSD and closed
    with TieredStore(cfg) as reopened:
        assert reopened.contains(["x"]) == [True]
    c = acquire_store(cfg)
    assert c is not a
    release_store(c)


def test_drain_waits_for_every_save(store: TieredStore) -> None:
    slow = _BlockingStore(store)
    client = KVClient(slow, io_workers=2).start()
    try:
        futs = [client.save([f"w/{i}"], [obj(i)]) for i in range(2)]
        assert client.drain(timeout_s=0.2) is False  # both puts are held back
        slow.gate.set()
        assert client.drain(timeout_s=10) is True
        assert all(f.done() for f in futs)
        assert store.exists(["w/0", "w/1"]) == 2
    finally:
        slow.gate.set()
        client.close()


def test_a_load_behind_stuck_saves_fails_within_its_timeout(store: TieredStore) -> None:
    """Every batch slot is taken by saves a stuck store never finishes: a load with a timeout gives
    up after it (each key IO_ERROR, leases released) instead of blocking the engine's forward."""
    slow = _BlockingStore(store)
    unpinned: list[str] = []
    slow.unpin = lambda keys: unpinned.extend(keys)  # type: ignore[method-assign]
    client = KVClient(slow, io_workers=1, max_pending_batches=2).start()
    try:
        assert store.put(["ready"], [obj(1)]) == [Status.OK]
        saves = [client.save([f"s/{i}"], [obj(i)]) for i in range(2)]
        t0 = time.monotonic()
        res = client.load(["ready"], [np.zeros(SIZE, np.uint8)], unpin_after=True, timeout_s=0.3).result(1)
        assert time.monotonic() - t0 < 2.0
        assert [r.status for r in res] == [Status.IO_ERROR]
        assert client.stats()["load_failed"] == 1
        assert unpinned == ["ready"]  # the lease taken for the load is released
        # A load of a key whose save is stuck waits at most its timeout too.
        t0 = time.monotonic()
        res = client.load(["s/0"], [np.zeros(SIZE, np.uint8)], timeout_s=0.3).result(1)
        assert time.monotonic() - t0 < 2.0 and not res[0].ok
        slow.gate.set()
        assert [f.result(10) for f in saves] == [[Status.OK], [Status.OK]]
        assert client.load(["s/1"], [np.zeros(SIZE, np.uint8)], timeout_s=5).result(10)[0].ok
    finally:
        slow.gate.set()
        client.close()


def test_a_lease_refused_for_want_of_room_is_read_instead(tmp_path: Path) -> None:
    """A step may load more than the DRAM tier holds (every object on SSD only, eight fit): the
    store refuses the leases it cannot make room for (NO_SPACE), and the client reads those
    objects with get_into instead, so a small DRAM tier costs a copy, never a recompute."""
    with TieredStore({"dram": {"capacity_bytes": 8 * SIZE}, "ssd": {"path": str(tmp_path / "ssd")}}) as s:
        keys = [f"k{i}" for i in range(24)]
        for i, k in enumerate(keys):
            assert s.put([k], [obj(i)]) == [Status.OK]
            assert s.flush(timeout_s=60)  # on SSD before DRAM needs its room
        assert s.contains(keys) == [True] * 24
        with KVClient(s) as client:
            leases = client.lease(keys, ttl_s=30, size=SIZE)
            assert [ls.status for ls in leases] == [Status.OK] * 24
            assert any(isinstance(ls, CopiedLease) for ls in leases)  # the fallback was taken
            for i, ls in enumerate(leases):
                assert bytes(ls.layer(0, SIZE)) == obj(i).tobytes()
            assert client.release(leases) == [True] * 24
            assert client.counters.loaded_objects == 24 and client.counters.load_failed == 0
        assert s.stats().slots.leases == 0
