"""The registrar in one process over a real TieredStore and the embedded directory: residency events
become registrations (with xxh3 of DRAM objects) and unregistrations, and every kind of resync
(start, a heartbeat finding the node unknown, dropped events) brings the directory back to what
the node holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from store_backend.pool.directory import Location
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.registrar import Registrar, node_info
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.transport_helpers import payload

MiB = 1 << 20
SIZE = 256 << 10


def _located(d: EmbeddedDirectory, keys: list[str]) -> list[list[Location]]:
    return d.locate(keys)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = TieredStore({"dram": {"capacity_bytes": 2 * MiB},
                     "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB}}).start()
    yield s
    s.close(flush=False)


def _registrar(store: TieredStore, d: EmbeddedDirectory, **kw) -> Registrar:
    return Registrar(store, d, "N", info=lambda: node_info(store, "N", "127.0.0.1:1", 1), heartbeat_s=0.1,
                     node_ttl_s=2.0, **kw).start()


def test_events_register_with_checksums_moves_and_removes_follow(store: TieredStore) -> None:
    d = EmbeddedDirectory()
    reg = _registrar(store, d)
    try:
        keys = [f"k{i}" for i in range(4)]
        assert store.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * 4
        wait_until(lambda: all(_located(d, keys)), 10, "registered")
        for k, locs in zip(keys, _located(d, keys)):
            assert locs == [Location("N", "dram", SIZE, xxhash.xxh3_64_intdigest(payload(k, SIZE).tobytes()))]
        # More than DRAM holds: the first ones are evicted to SSD and re-registered there, checksum kept.
        more = [f"m{i}" for i in range(10)]
        for k in more:
            assert store.put([k], [payload(k, SIZE)]) == [Status.OK]
            assert store.flush(timeout_s=30)
        assert reg.wait_idle(10)
        tiers = store.tier_of(keys, local_only=True)
        assert "ssd" in tiers, tiers
        for k, t, locs in zip(keys, tiers, _located(d, keys)):
            assert [(loc.tier, loc.checksum) for loc in locs] == [
                (t, xxhash.xxh3_64_intdigest(payload(k, SIZE).tobytes()))], k
        assert store.remove(["k0"]) == [Status.OK]
        wait_until(lambda: _located(d, ["k0"]) == [[]], 10, "k0 unregistered")
        assert "k0" not in d.node_keys("N")
    finally:
        reg.close()
        d.close()


def test_a_directory_that_lost_the_node_and_dropped_events_are_resynced(store: TieredStore) -> None:
    d = EmbeddedDirectory()
    reg = _registrar(store, d, checksum=False)
    try:
        keys = [f"r{i}" for i in range(3)]
        assert store.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * 3
        wait_until(lambda: all(_located(d, keys)), 10, "registered")
        assert all(loc.checksum == 0 for locs in _located(d, keys) for loc in locs)  # checksum off
        resyncs = reg.counters["resyncs"]
        d.deregister_node("N")  # as a Redis restarted empty: the node and its locations are gone
        assert _located(d, keys) == [[], [], []]
        wait_until(lambda: all(_located(d, keys)), 10, "re-registered after the heartbeat found it unknown")
        assert reg.counters["resyncs"] > resyncs
        # Dropped events (the bus's gap): a key stored meanwhile, and a location of a key the node
        # no longer holds, are both put right by the resync.
        reg.close()
        assert store.put(["late"], [payload("late", SIZE)]) == [Status.OK]
        d.register("N", [("phantom", Location("N", "dram", SIZE))])
        reg = _registrar(store, d, checksum=False)
        reg._on_gap()
        wait_until(lambda: _located(d, ["late", "phantom"]) == [[Location("N", "dram", SIZE)], []], 10, "resynced")
    finally:
        reg.close()
        d.close()
