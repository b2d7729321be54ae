"""PoolTier in one process over real TCP: a local TieredStore whose last tier is the pool, reading
from peers' TieredStores served by TcpTransportServer, located through an EmbeddedDirectory."""

from __future__ import annotations

import socket
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
from prometheus_client.parser import text_string_to_metric_families

from store_backend.pool.directory import DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.service import local_view
from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_server import TcpTransportServer
from store_backend.pool.tier import PoolTier
from store_backend.prometheus import StoreCollector
from store_backend.store import TieredStore
from store_backend.types import Status

from tests.store_backend.pool.transport_helpers import SECRET, FlipProxy, payload, wait_for

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

    def register(self, keys: list[str], size: int = SIZE) -> None:
        tiers = self.store.tier_of(keys, local_only=True)
        entries = []
        for k, t in zip(keys, tiers):
            assert t is not None, k
            entries.append((k, Location(self.node_id, t, size, xxh3(payload(k, size)))))
        self.directory.register(self.node_id, entries)

    def close(self) -> None:
        self.server.close()
        self.store.close(flush=False)


def serving_peer(stack: ExitStack, directory: Any, node_id: str, keys: list[str], size: int = SIZE) -> Peer:
    """A DRAM-only peer ``node_id`` (closed with ``stack``) holding ``keys`` (``payload`` bytes of
    ``size``), registered in ``directory``."""
    p = Peer(node_id, _peer_store(None), directory)
    stack.callback(p.close)
    assert p.store.put(keys, [payload(k, size) for k in keys]) == [Status.OK] * len(keys)
    p.register(keys, size)
    return p


def xxh3(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(a.tobytes())


@contextmanager
def local_node(directory: Any, node_id: str = "A", transport: TcpTransport | None = None,
               **tier_kw: Any) -> Iterator[tuple[TieredStore, PoolTier]]:
    """This node: a DRAM store whose last tier is a PoolTier (``tier_kw``; timeout_s 5 s unless
    given) reading through ``transport`` (default: a new TcpTransport; closed at the end either way)."""
    tier = PoolTier(node_id, **{"timeout_s": 5.0, **tier_kw})
    transport = transport or TcpTransport(SECRET)
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
        b = serving_peer(stack, directory, "B", dram_keys)
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
        serving_peer(stack, d, "B", ["k"])
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
        time.sleep(1.05)  # past retry_after_s (1 s): the next lookup asks the directory again
        buf = bytearray(SIZE)
        assert store.get_into(["k"], [buf])[0].status is Status.OK and bytes(buf) == payload("k", SIZE).tobytes()


def test_remove_goes_through_the_pool_to_every_live_holder(directory: EmbeddedDirectory) -> None:
    with ExitStack() as stack:
        b = serving_peer(stack, directory, "B", ["k", "j"])
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
        keys = ["p0", "p1", "p2"]
        serving_peer(stack, directory, "B", keys)
        store, _tier = stack.enter_context(local_node(directory))
        assert store.pin(keys) == [True] * 3  # queues their promotion: read from B into DRAM
        assert store.wait_idle(10, offload=False, events=False)
        assert store.tier_of(keys, local_only=True) == ["dram"] * 3
        st = store.stats().pool
        assert st.hits == 3 and st.bytes_read == 3 * SIZE


# Batch 1: 24 objects of 128 KiB per peer (3 MiB: enough for a second stream, which takes at
# least MIN_STREAM_BYTES = 1 MiB); batch 2: 550 objects of 4 KiB per peer (past KEYS_PER_FRAME =
# 512 keys in one request frame: two frames, the first 2 MiB).
# Get requests each peer's server sees per batch: with one stream, one per frame; with two, a
# frame is also split by bytes over both streams (one request each, in parallel), a small one not.
_REQUESTS_PER_PEER = {1: (1, 2), 2: (2, 3)}


@pytest.mark.parametrize("streams", sorted(_REQUESTS_PER_PEER))
def test_a_batch_is_one_get_request_per_peer_not_one_per_key(directory: EmbeddedDirectory, streams: int) -> None:
    """A get_into of many keys held by two peers, interleaved in the batch, sends each peer's
    transport server one get request for its share (its "requests" counter), one more per stream
    or per 512-key frame only, never one per key; the client sent no other request, and every
    object arrives byte for byte."""
    from store_backend.pool.tcp_common import KEYS_PER_FRAME

    batches = [([f"big{i}" for i in range(48)], 128 << 10), ([f"small{i}" for i in range(1100)], 4 << 10)]
    assert len(batches[1][0]) // 2 > KEYS_PER_FRAME  # each peer's share of batch 2 needs two frames
    with ExitStack() as stack:
        peers = []
        for node in ("B", "C"):
            p = Peer(node, _peer_store(None), directory)
            stack.callback(p.close)
            peers.append(p)
        for keys, size in batches:
            for j, p in enumerate(peers):  # even keys on B, odd keys on C
                mine = keys[j::2]
                assert p.store.put(mine, [payload(k, size) for k in mine]) == [Status.OK] * len(mine)
                p.register(mine, size)
        transport = TcpTransport(SECRET, streams=streams)
        store, tier = stack.enter_context(local_node(directory, transport=transport))
        for (keys, size), per_peer in zip(batches, _REQUESTS_PER_PEER[streams]):
            served_before = [p.server.stats()["requests"] for p in peers]
            sent_before = transport.stats()["requests"]
            bufs = [bytearray(size) for _ in keys]
            assert [r.status for r in store.get_into(keys, bufs)] == [Status.OK] * len(keys)
            for k, buf in zip(keys, bufs):
                assert bytes(buf) == payload(k, size).tobytes(), k
            served = [p.server.stats()["requests"] - b for p, b in zip(peers, served_before)]
            assert served == [per_peer, per_peer], (len(keys), size, served)
            assert transport.stats()["requests"] - sent_before == 2 * per_peer
        assert tier.extra_stats()["hits"] == sum(len(keys) for keys, _ in batches)


def _pool_samples(store: TieredStore) -> dict[str, float]:
    """The pool tier's samples in the store's Prometheus exposition, rendered and parsed back as
    a scrape reads them: ``name`` or ``name{kind}`` (failures) -> value."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.labels.get("tier") == "pool":
                kind = sample.labels.get("kind")
                out[f"{sample.name}{{{kind}}}" if kind else sample.name] = sample.value
    return out


def test_the_pool_tiers_hits_misses_bytes_and_failures_by_kind_are_exported_by_value(
        directory: EmbeddedDirectory) -> None:
    """One get_into over a peer that serves four keys (hits), two keys no node holds, a peer whose
    bytes are flipped on the way (a relay: CORRUPT against the directory's checksum), a peer that
    accepts connections and never answers (timeout) and one whose port is closed (peer gone): the
    store's Prometheus exposition shows, under tier="pool", exactly 4 hits, 4 objects' bytes read,
    5 misses (the absent and the failed keys), and failures checksum 1, timeout 1, peer_gone 1,
    every other kind 0."""
    fam = "mooncake_kv_tier_"
    with ExitStack() as stack:
        hits = [f"h{i}" for i in range(4)]
        serving_peer(stack, directory, "B", hits)
        c = serving_peer(stack, directory, "C", ["flip"])
        # C is dialled through a relay that flips one byte of what C sends, inside the object
        # (past the greeting and the reply header).
        proxy = FlipProxy(c.server.address, flip_at=64 << 10, direction="down")
        stack.callback(proxy.close)
        directory.heartbeat(NodeInfo("C", proxy.address), 30.0)
        # D: the kernel accepts its connections (backlog), nothing ever answers.
        mute = socket.create_server(("127.0.0.1", 0))
        stack.callback(mute.close)
        directory.heartbeat(NodeInfo("D", "127.0.0.1:%d" % mute.getsockname()[1]), 30.0)
        directory.register("D", [("slow", Location("D", "dram", SIZE, xxh3(payload("slow", SIZE))))])
        # E: alive in the directory, its port closed (connection refused).
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            gone_port = s.getsockname()[1]
        directory.heartbeat(NodeInfo("E", f"127.0.0.1:{gone_port}"), 30.0)
        directory.register("E", [("gone", Location("E", "dram", SIZE, xxh3(payload("gone", SIZE))))])
        store, _tier = stack.enter_context(local_node(directory, timeout_s=1.0))
        before = _pool_samples(store)
        assert before[f"{fam}hits_total"] == before[f"{fam}misses_total"] == before[f"{fam}read_bytes_total"] == 0
        keys = [*hits, "flip", "slow", "gone", "absent0", "absent1"]
        bufs = [bytearray(SIZE) for _ in keys]
        got = [r.status for r in store.get_into(keys, bufs)]
        assert got == [Status.OK] * 4 + [Status.CORRUPT, Status.IO_ERROR, Status.IO_ERROR] + [Status.NOT_FOUND] * 2
        assert all(bytes(buf) == payload(k, SIZE).tobytes() for k, buf in zip(hits, bufs))
        assert proxy.flipped == 1
        samples = _pool_samples(store)
        assert samples[f"{fam}hits_total"] == 4
        assert samples[f"{fam}read_bytes_total"] == 4 * SIZE
        assert samples[f"{fam}misses_total"] == 5
        failures = {k.split("{")[1].rstrip("}"): v for k, v in samples.items() if k.startswith(f"{fam}failures_total")}
        assert failures == {"checksum": 1, "io_error": 0, "capacity": 0, "peer_gone": 1, "timeout": 1,
                            "refused": 0, "protocol": 0, "directory": 0}


def test_a_lease_of_a_key_no_node_holds_counts_a_pool_miss_as_get_into_does(directory: EmbeddedDirectory) -> None:
    """The node service's read path (lease, staging in from the tiers below) counts a key that no
    node holds as a miss of the pool tier, as get_into does, and a key a peer serves as a hit
    only: the two paths give the pool tier the same misses for the same keys."""
    with ExitStack() as stack:
        serving_peer(stack, directory, "B", ["g", "l"])
        store, _tier = stack.enter_context(local_node(directory))
        assert [r.status for r in store.get_into(["g", "absent-g"], [bytearray(SIZE), bytearray(SIZE)])] == \
            [Status.OK, Status.NOT_FOUND]
        st = store.stats().pool
        assert (st.hits, st.misses) == (1, 1)
        leases = store.lease(["l", "absent-l"])
        assert [ls.status for ls in leases] == [Status.OK, Status.NOT_FOUND]
        assert bytes(leases[0].view) == payload("l", SIZE).tobytes()
        assert store.release(leases[:1]) == [True]
        st = store.stats().pool
        assert (st.hits, st.misses) == (2, 2)
        assert _pool_samples(store)["mooncake_kv_tier_misses_total"] == 2


def test_a_wait_at_the_holder_returns_on_its_commit_and_reads_from_it_before_the_directory_knows() -> None:
    """``wait_at`` (a decode node waiting for a prefill node's saves): answered when the holder
    commits, not at the end of the wait; the keys are then found and read from that holder though
    the directory has no record of them (its registration on the way) and while the directory is
    down; a remove through this node ends that. A key the holder never commits is not there."""
    import threading

    d = DownDirectory()
    keys = ["t/0", "t/1", "t/2"]
    with ExitStack() as stack:
        b = Peer("B", _peer_store(None), d)  # holds nothing yet, registers nothing
        stack.callback(b.close)
        store, tier = stack.enter_context(local_node(d))
        held = b.store.reserve(keys, [SIZE] * 3)
        for r, k in zip(held, keys):
            r.view[:] = memoryview(payload(k, SIZE)).cast("B")

        def commit_once_the_wait_is_there() -> None:
            assert wait_for(lambda: b.server.stats()["waiting"] == 1, 10.0)  # the wait is held at B
            assert b.store.commit(held) == [Status.OK] * 3

        threading.Thread(target=commit_once_the_wait_is_there, daemon=True).start()
        t0 = time.monotonic()
        assert tier.wait_at("B", keys, 20.0) == 3
        assert time.monotonic() - t0 < 5.0
        assert d.locate(keys) == [[], [], []]  # the directory does not know them
        d.down = True
        assert store.exists(keys) == 3
        bufs = [bytearray(SIZE) for _ in keys]
        assert [r.status for r in store.get_into(keys, bufs)] == [Status.OK] * 3
        for k, buf in zip(keys, bufs):
            assert bytes(buf) == payload(k, SIZE).tobytes(), k
        d.down = False
        stats = tier.extra_stats()
        assert (stats["waits"], stats["waits_ready"], stats["waited_keys"]) == (1, 1, 3)
        # A key the holder never commits: the wait ends at its deadline with the leading ones.
        assert tier.wait_at("B", ["t/0", "t/never", "t/2"], 0.5) == 1
        # A node the directory has no address for cannot be waited on.
        assert tier.wait_at("nobody", keys, 5.0) == 0
        # A remove that reaches this node while a wait is on its way: the wait's answer installs no
        # hint for that key (the holder may not have been reached by the remove yet).
        late = b.store.reserve(["t/late"], [SIZE])
        late[0].view[:] = memoryview(payload("t/late", SIZE)).cast("B")
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(tier.wait_at("B", ["t/late"], 20.0)))
        waiter.start()
        assert wait_for(lambda: b.server.stats()["waiting"] == 1, 10.0)  # the wait is held at B
        tier.forget_cached(["t/late"])  # what a peer's remove of the key does here first
        assert b.store.commit(late) == [Status.OK]
        waiter.join(20)
        assert got == [1]
        d.down = True
        assert store.exists(["t/late"]) == 0  # no hint: with the directory down, a miss
        d.down = False
        # This node's remove of a key drops its confirmed holder (the remove reached B too).
        assert b.store.put(["t/3"], [payload("t/3", SIZE)]) == [Status.OK]
        assert tier.wait_at("B", ["t/3"], 1.0) == 1
        store.remove(["t/3"])
        assert store.exists(["t/3"]) == 0
