"""PoolTier in one process over real TCP: a local TieredStore whose last tier is the pool, reading
from peers' TieredStores served by TcpTransportServer, located through an EmbeddedDirectory."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from prometheus_client import CollectorRegistry, generate_latest

from store_backend.pool.directory import DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.service import local_view
from store_backend.pool.tcp import TcpTransport, TcpTransportServer
from store_backend.pool.tier import PoolTier
from store_backend.prometheus import StoreCollector
from store_backend.store import TieredStore
from store_backend.types import Status

from tests.store_backend.pool.transport_helpers import SECRET, payload

MiB = 1 << 20
SIZE = 256 << 10


def _peer_store(path: Path | None) -> TieredStore:
    cfg: dict[str, Any] = {"dram": {"capacity_bytes": 16 * MiB, "shm_name": f"mkv-pt-{uuid.uuid4().hex[:10]}"}}
    if path is not None:
        cfg["ssd"] = {"path": str(path), "capacity_bytes": 64 * MiB}
    return TieredStore(cfg, fresh_segment=True).start()


class Peer:
    """A peer node: its store, served over TCP, registered in the directory under ``node_id``."""

    def __init__(self, node_id: str, store: TieredStore, directory: EmbeddedDirectory) -> None:
        self.node_id, self.store, self.directory = node_id, store, directory
        self.server = TcpTransportServer(local_view(store), SECRET)
        self.server.start()
        directory.heartbeat(NodeInfo(node_id, self.server.address), 30.0)

    def register(self, keys: list[str]) -> None:
        tiers = self.store.tier_of(keys, local_only=True)
        entries = []
        for k, t in zip(keys, tiers):
            assert t is not None, k
            entries.append((k, Location(self.node_id, t, SIZE, xxh3(payload(k, SIZE)))))
        self.directory.register(self.node_id, entries)

    def close(self) -> None:
        self.server.close()
        self.store.close(flush=False)


def xxh3(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(a.tobytes())


@contextmanager
def local_node(directory: Any, node_id: str = "A", **tier_kw: Any) -> Iterator[tuple[TieredStore, PoolTier]]:
    tier = PoolTier(node_id, timeout_s=5.0, **tier_kw)
    transport = TcpTransport(SECRET)
    store = TieredStore({"dram": {"capacity_bytes": 16 * MiB}}, tiers=[tier]).start()
    tier.bind(directory, transport)
    try:
        yield store, tier
    finally:
        store.close(flush=False)
        transport.close()


@pytest.fixture
def directory() -> Iterator[EmbeddedDirectory]:
    d = EmbeddedDirectory()
    yield d
    d.close()


def _evicted_to_ssd(tmp_path: Path, keys: list[str]) -> TieredStore:
    """A store whose ``keys`` are on SSD only: written and flushed by one store, opened again."""
    first = _peer_store(tmp_path)
    assert first.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * len(keys)
    assert first.flush(timeout_s=30)
    first.close()
    again = _peer_store(tmp_path)
    assert again.tier_of(keys, local_only=True) == ["ssd"] * len(keys)
    return again


def test_reads_come_from_peers_dram_and_ssd_byte_identical_and_stay_as_local_replicas(
        tmp_path: Path, directory: EmbeddedDirectory) -> None:
    dram_keys = [f"d{i}" for i in range(6)]
    ssd_keys = [f"s{i}" for i in range(6)]
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), directory)
        stack.callback(b.close)
        assert b.store.put(dram_keys, [payload(k, SIZE) for k in dram_keys]) == [Status.OK] * 6
        b.register(dram_keys)
        c = Peer("C", _evicted_to_ssd(tmp_path / "c", ssd_keys), directory)
        stack.callback(c.close)
        c.register(ssd_keys)
        store, tier = stack.enter_context(local_node(directory))
        keys = [*dram_keys, *ssd_keys, "absent"]
        assert store.tier_of(keys) == ["pool"] * 12 + [None]
        assert store.exists(keys) == 12 and store.size_of(["s0", "absent"]) == [SIZE, None]
        bufs = [bytearray(SIZE) for _ in keys]
        got = store.get_into(keys, bufs)
        assert [r.status for r in got] == [Status.OK] * 12 + [Status.NOT_FOUND]
        for k, buf in zip(keys[:-1], bufs):
            assert bytes(buf) == payload(k, SIZE).tobytes(), k
        # Each remote hit stays as a local DRAM replica, and this node's own view says so.
        assert store.tier_of(keys[:-1], local_only=True) == ["dram"] * 12
        assert sorted(store.keys()) == sorted(keys[:-1])
        st = store.stats()
        assert st.pool.hits == 12 and st.pool.bytes_read == 12 * SIZE
        assert tier.extra_stats()["hits"] == 12
        # Leases (the node service's read path) stage in from the pool too.
        with ExitStack():
            more = [f"m{i}" for i in range(3)]
            assert b.store.put(more, [payload(k, SIZE) for k in more]) == [Status.OK] * 3
            b.register(more)
            leases = store.lease(more)
            assert [ls.status for ls in leases] == [Status.OK] * 3
            for k, ls in zip(more, leases):
                assert bytes(ls.view) == payload(k, SIZE).tobytes()
            assert store.release(leases) == [True] * 3
            assert store.tier_of(more, local_only=True) == ["dram"] * 3


def test_a_dead_replica_is_retried_on_the_next_and_failures_are_counted_by_kind(
        directory: EmbeddedDirectory) -> None:
    keys = [f"k{i}" for i in range(8)]
    with ExitStack() as stack:
        peers = []
        for node in ("B", "C"):
            p = Peer(node, _peer_store(None), directory)
            stack.callback(p.close)
            assert p.store.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * 8
            p.register(keys)
            peers.append(p)
        store, tier = stack.enter_context(local_node(directory))
        peers[0].server.close()  # B's listener is gone, its directory entries stay (its mark has not expired)
        bufs = [bytearray(SIZE) for _ in keys]
        got = store.get_into(keys, bufs)
        assert [r.status for r in got] == [Status.OK] * 8
        assert all(bytes(b) == payload(k, SIZE).tobytes() for k, b in zip(keys, bufs))
        extra = tier.extra_stats()
        assert extra["retries"] == 8 and extra["failures_peer_gone"] >= 1
        assert store.stats().pool.failures.peer_gone >= 1


def test_a_checksum_mismatch_with_the_directory_is_a_failed_read_never_the_bytes(directory: EmbeddedDirectory) -> None:
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), directory)
        stack.callback(b.close)
        assert b.store.put(["k"], [payload("k", SIZE)]) == [Status.OK]
        directory.register("B", [("k", Location("B", "dram", SIZE, xxh3(payload("other", SIZE))))])
        store, tier = stack.enter_context(local_node(directory))
        buf = bytearray(SIZE)
        assert store.get_into(["k"], [buf])[0].status is Status.CORRUPT
        assert store.tier_of(["k"], local_only=True) == [None]  # nothing kept
        assert store.stats().pool.failures.checksum == 1
        # With checksums off (pool.checksum false), only the frame's own checksum is checked.
        with local_node(directory, node_id="A2", checksum=False) as (store2, _t):
            buf = bytearray(SIZE)
            assert store2.get_into(["k"], [buf])[0].status is Status.OK
            assert bytes(buf) == payload("k", SIZE).tobytes()


class DownDirectory(EmbeddedDirectory):
    """Fault injection: an embedded directory whose lookups fail as an unreachable Redis does."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.lookups = 0

    def locate(self, keys: Any, *, exclude: str | None = None) -> Any:
        self.lookups += 1
        if self.down:
            time.sleep(0.2)  # what an op_timeout_s costs
            raise DirectoryUnavailable("connection refused")
        return super().locate(keys, exclude=exclude)


def test_a_directory_outage_is_answered_as_misses_at_once_for_retry_after_s() -> None:
    d = DownDirectory()
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), d)
        stack.callback(b.close)
        assert b.store.put(["k"], [payload("k", SIZE)]) == [Status.OK]
        b.register(["k"])
        store, tier = stack.enter_context(local_node(d, retry_after_s=1.0))
        assert store.put(["mine"], [payload("mine", SIZE)]) == [Status.OK]
        d.down = True
        t0 = time.monotonic()
        assert store.get_into(["k"], [bytearray(SIZE)])[0].status is Status.NOT_FOUND
        lookups = d.lookups
        for _ in range(20):  # within retry_after_s: no directory call, no stall
            assert store.get_into(["k"], [bytearray(SIZE)])[0].status is Status.NOT_FOUND
            assert store.contains(["k"]) == [False]
        assert d.lookups == lookups and time.monotonic() - t0 < 1.0
        # This node's own objects are served all along.
        buf = bytearray(SIZE)
        assert store.get_into(["mine"], [buf])[0].status is Status.OK and bytes(buf) == payload("mine", SIZE).tobytes()
        assert tier.extra_stats()["failures_directory"] >= 21 and store.stats().pool.failures.directory >= 21
        # The same counts in the Prometheus families the local tiers use (tier="pool", by kind).
        registry = CollectorRegistry()
        registry.register(StoreCollector(store))
        text = generate_latest(registry).decode()
        line = next(x for x in text.splitlines()
                    if x.startswith("mooncake_kv_tier_failures_total{") and 'tier="pool"' in x and 'kind="directory"' in x)
        assert float(line.rsplit(" ", 1)[1]) >= 21
        assert 'mooncake_kv_tier_failures_total{kind="peer_gone",tier="pool"}' in text
        d.down = False
        time.sleep(1.05)
        buf = bytearray(SIZE)
        assert store.get_into(["k"], [buf])[0].status is Status.OK and bytes(buf) == payload("k", SIZE).tobytes()


def test_remove_goes_through_the_pool_to_every_live_holder(directory: EmbeddedDirectory) -> None:
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), directory)
        stack.callback(b.close)
        assert b.store.put(["k", "j"], [payload("k", SIZE), payload("j", SIZE)]) == [Status.OK] * 2
        b.register(["k", "j"])
        store, _tier = stack.enter_context(local_node(directory))
        assert store.get_into(["k"], [bytearray(SIZE)])[0].status is Status.OK  # a local replica now
        assert store.remove(["k", "absent"]) == [Status.OK, Status.NOT_FOUND]
        assert b.store.contains(["k", "j"]) == [False, True]
        assert directory.locate(["k", "j"]) == [[], [Location("B", "dram", SIZE, xxh3(payload("j", SIZE)))]]
        assert store.contains(["k"]) == [False] and store.get_into(["k"], [bytearray(SIZE)])[0].status \
            is Status.NOT_FOUND
        # A peer asked through the transport removes its own copy only (local_only): no loop.
        assert b.store.remove(["j"], local_only=True) == [Status.OK]


def test_objects_a_pin_promotes_from_the_pool_count_as_pool_hits(directory: EmbeddedDirectory) -> None:
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), directory)
        stack.callback(b.close)
        keys = ["p0", "p1", "p2"]
        assert b.store.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * 3
        b.register(keys)
        store, _tier = stack.enter_context(local_node(directory))
        assert store.pin(keys) == [True] * 3  # queues their promotion: read from B into DRAM
        assert store._promoter.wait_idle(10)
        assert store.tier_of(keys, local_only=True) == ["dram"] * 3
        st = store.stats().pool
        assert st.hits == 3 and st.bytes_read == 3 * SIZE
