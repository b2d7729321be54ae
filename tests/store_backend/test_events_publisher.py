"""A store's KV events through ZMQ into the index: after a randomized workload with evictions,
promotions and removes, the index holds exactly what the store lists per medium; the same after
forced gaps (resynced by snapshot), a replay, and a source that restarts. Real sockets, a real
store with an SSD tier; a hand-written publisher injects the faults the real one never makes."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import zmq

from mooncake_kv.index.service import IndexConfig, KVIndex
from store_backend.events.subscriber import SourceConfig
from store_backend.events.config import EventsConfig
from store_backend.events.publisher import SNAPSHOT, KVEventPublisher
from store_backend.events.translate import stored
from store_backend.events.wire import END_SEQ, KVEventBatch, decode_batch, encode_batch, seq_bytes, seq_of
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.node.server_harness import wait_until

KiB, MiB = 1 << 10, 1 << 20
OBJ = 64 * KiB
LOCAL = "tcp://127.0.0.1:*"


def _store(tmp_path) -> TieredStore:  # noqa: ANN001
    return TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
                        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 3 * MiB, "backend": "file",
                                "admission_policy": "all"},
                        "offload": {"policy": "eager"},
                        "promotion": {"enabled": True, "admission_hits": 1}}).start()


def _publisher(store: TieredStore, **kw) -> KVEventPublisher:  # noqa: ANN003
    return KVEventPublisher(store, EventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, **kw), "node-t").start()


def _index(pub: KVEventPublisher) -> KVIndex:
    src = SourceConfig(name="node-t", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, snapshot=True)
    index = KVIndex(IndexConfig(sources=[src])).start()
    assert index.wait_synced(10), index.status()
    return index


def _workload(store: TieredStore, rng: random.Random, n: int, tag: str = "w") -> None:
    keys: list[str] = []
    buf = np.empty(OBJ, np.uint8)
    for i in range(n):
        op = rng.random()
        if op < 0.6 or not keys:
            k = f"d{rng.randrange(3)}/{tag}{i}"
            assert store.put([k], [np.full(OBJ, i % 251, np.uint8)])[0] in (Status.OK, Status.NO_SPACE)
            keys.append(k)
        elif op < 0.8:
            store.get_into([rng.choice(keys)], [buf])  # an SSD hit is promoted
        else:
            store.remove([rng.choice(keys)])


def _converged(store: TieredStore, pub: KVEventPublisher, index: KVIndex) -> None:
    """Wait until the index absorbed the store's last change, then compare per medium."""
    assert store.wait_idle(30)
    assert pub.wait_published(10)
    sub = index.subscriber("node-t")
    wait_until(lambda: sub.stats()["next_seq"] == pub.stats()["next_seq"], 10, "the index at the last batch")
    listing = store.residency()
    assert index.blocks("node-t", "CPU") == {k.encode() for k in listing["dram"]}
    assert index.blocks("node-t", "STORAGE") == {k.encode() for k in listing["ssd"]}


@pytest.mark.parametrize("seed", [1, 2])
def test_the_index_rebuilt_from_events_equals_the_store(tmp_path, seed: int) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    pub = _publisher(store)
    try:
        _workload(store, random.Random(seed), 60)  # before the index: its first snapshot holds it
        index = _index(pub)
        try:
            _workload(store, random.Random(seed + 100), 300, "v")
            _converged(store, pub, index)
            got = store.stats()
            assert got.tiers["dram"].evictions > 0 and got.tiers["ssd"].evictions > 0  # the workload evicts
            assert pub.stats()["gaps"] == 0 and index.subscriber("node-t").stats()["snapshots"] == 1
        finally:
            index.close()
    finally:
        pub.close()
        store.close(flush=False)


def test_a_gap_is_seen_at_once_and_resynced_by_snapshot(tmp_path) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    pub = _publisher(store, queue_max=4)  # drops in every burst
    index = _index(pub)
    try:
        _workload(store, random.Random(7), 200)
        _converged(store, pub, index)
        assert pub.stats()["gaps"] > 0 and pub.stats()["dropped"] > 0
        stats = index.subscriber("node-t").stats()
        assert stats["gaps"] > 0 and stats["snapshots"] > 1
    finally:
        index.close()
        pub.close()
        store.close(flush=False)


def _ask(endpoint: str, body: bytes) -> list[tuple[int, bytes]]:
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        d.send_multipart((b"", body))
        out = []
        while True:
            assert d.poll(10_000), "no reply"
            frames = d.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append((seq_of(frames[2]), frames[3]))
    finally:
        d.close()


def test_replay_and_snapshot_requests(tmp_path) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    pub = _publisher(store)
    try:
        for i in range(3):
            assert store.put([f"m/{i}"], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
            assert store.wait_idle(10) and pub.wait_published(10)
        n = pub.stats()["next_seq"]
        assert n >= 3
        replayed = _ask(pub.replay_endpoint, seq_bytes(1))
        assert [s for s, _ in replayed] == list(range(1, n))
        snap = _ask(pub.replay_endpoint, SNAPSHOT)
        assert {s for s, _ in snap} == {n}
        keys = {h for _, p in snap for e in decode_batch(p).events for h in e.block_hashes}
        listing = store.residency()
        assert keys == {k.encode() for k in listing["dram"] + listing["ssd"]}
        assert _ask(pub.replay_endpoint, b"abc") == [] and pub.stats()["bad_requests"] == 1
    finally:
        pub.close()
        store.close(flush=False)


class HandPublisher:
    """PUB and ROUTER by hand: sends chosen sequence numbers, replays from a chosen store."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pub, self.router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # XPUB: sees subscriptions
        self.pub.bind(LOCAL)
        self.router.bind(LOCAL)
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.kept: dict[int, bytes] = {}

    def wait_subscriber(self) -> None:
        """Until a subscriber's subscription arrived (a message sent before would be lost)."""
        assert self.pub.poll(10_000), "no subscriber"
        assert self.pub.recv()[:1] == b"\x01"

    @staticmethod
    def batch(*keys: str) -> bytes:
        return encode_batch(KVEventBatch(ts=time.time(), events=[stored(list(keys), "CPU", "h")]))

    def send(self, seq: int, payload: bytes, *, keep: bool = True) -> None:
        if keep:
            self.kept[seq] = payload
        self.pub.send_multipart((b"", seq_bytes(seq), payload))

    def serve_one(self, timeout_ms: int = 10_000) -> None:
        assert self.router.poll(timeout_ms), "no replay request"
        ident, _, body = self.router.recv_multipart()
        start = int.from_bytes(body, "big")
        for seq in sorted(self.kept):
            if seq >= start:
                self.router.send_multipart((ident, b"", b"", seq_bytes(seq), self.kept[seq]))
        self.router.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def test_a_missed_batch_is_replayed_and_a_restart_drops_the_old_entries() -> None:
    hp = HandPublisher()
    index = KVIndex(IndexConfig(sources=[SourceConfig(name="e", endpoint=hp.endpoint,
                                                      replay_endpoint=hp.replay_endpoint)])).start()
    sub = index.subscriber("e")
    try:
        hp.wait_subscriber()
        hp.send(0, hp.batch("a"))
        wait_until(lambda: sub.stats()["next_seq"] == 1, 10, "the first batch")
        hp.kept[1] = hp.batch("b")  # never sent live: the subscriber must ask for it
        hp.send(2, hp.batch("c"))
        hp.serve_one()
        wait_until(lambda: sub.stats()["next_seq"] == 3, 10, "the replayed batch")
        assert index.blocks("e", "CPU") == {b"a", b"b", b"c"} and sub.stats()["replayed"] >= 1
        # A replay with a hole (batch 4 never kept): batch 3 and 5 apply, only the hole is lost.
        hp.kept[3], hp.kept[5] = hp.batch("d"), hp.batch("f")
        hp.send(6, hp.batch("g"))
        hp.serve_one()
        wait_until(lambda: sub.stats()["next_seq"] == 7, 10, "the partly replayed batches")
        assert index.blocks("e", "CPU") == {b"a", b"b", b"c", b"d", b"f", b"g"} and sub.stats()["lost"] == 1
        hp.send(0, hp.batch("x"), keep=False)  # numbers go back: a new publisher
        wait_until(lambda: sub.stats()["restarts"] == 1, 10, "the restart")
        wait_until(lambda: index.blocks("e", "CPU") == {b"x"}, 10, "the restarted source's entries")
    finally:
        index.close()
        hp.close()


def _same(store: TieredStore, pub: KVEventPublisher, index: KVIndex) -> None:
    assert store.wait_idle(10) and pub.wait_published(10)
    sub = index.subscriber("node-t")
    wait_until(lambda: sub.synced.is_set() and sub.stats()["next_seq"] == pub.stats()["next_seq"], 10,
               "the index at the last batch")
    listing = store.residency()
    assert index.blocks("node-t", "CPU") == {k.encode() for k in listing["dram"]}
    assert index.blocks("node-t", "STORAGE") == {k.encode() for k in listing.get("ssd", [])}


def test_a_node_that_restarts_on_the_same_endpoints_is_rebuilt(tmp_path) -> None:  # noqa: ANN001
    """The new service's first batches are published before the SUB socket reconnects, so its
    numbers never go back: the reconnect itself makes the index take a snapshot."""
    from tests.ports import free_port

    config = EventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    a = TieredStore({"dram": {"capacity_bytes": 4 * MiB}}).start()
    pub_a = KVEventPublisher(a, config, "node-t").start()
    index = _index(pub_a)
    try:
        for k in ("old/0", "old/1"):
            assert a.put([k], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
        _same(a, pub_a, index)
        pub_a.close()
        a.close(flush=False)
        b = TieredStore({"dram": {"capacity_bytes": 4 * MiB}}).start()
        pub_b = KVEventPublisher(b, config, "node-t").start()
        try:
            for k in ("new/0", "new/1", "new/2"):
                assert b.put([k], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
            wait_until(lambda: index.subscriber("node-t").stats()["reconnects"] >= 1, 10, "the reconnect")
            _same(b, pub_b, index)
            assert index.blocks("node-t", "CPU") == {b"new/0", b"new/1", b"new/2"}
        finally:
            pub_b.close()
            b.close(flush=False)
    finally:
        index.close()


class SlowRemoves:
    """A real SSD backend whose removes wait first (to widen a race's window)."""

    def __init__(self, inner, wait_s: float) -> None:  # noqa: ANN001
        self.inner, self.wait_s = inner, wait_s

    def remove(self, keys):  # noqa: ANN001, ANN201
        time.sleep(self.wait_s)  # the window in which the racing put lands
        return self.inner.remove(keys)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_a_remove_racing_a_put_withdraws_the_deleted_ssd_copy(tmp_path) -> None:  # noqa: ANN001
    import threading

    from store_backend.config import load_config
    from store_backend.ssd.factory import open_ssd_backend

    config = load_config({"dram": {"capacity_bytes": 4 * MiB},
                          "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 16 * MiB, "backend": "file"},
                          "offload": {"policy": "watermark"}})
    store = TieredStore(config, ssd=SlowRemoves(open_ssd_backend(config.ssd), 0.3)).start()
    pub = _publisher(store)
    index = _index(pub)
    try:
        assert store.put(["d/K"], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
        assert store.flush(10)  # in DRAM and on SSD
        _same(store, pub, index)
        assert index.blocks("node-t", "STORAGE") == {b"d/K"}
        remover = threading.Thread(target=lambda: store.remove(["d/K"]))
        remover.start()
        wait_until(lambda: store.tier_of(["d/K"]) == [None], 5, "the remove under way")
        assert store.put(["d/K"], [np.ones(OBJ, np.uint8)]) == [Status.OK]  # lands while SSD deletes
        remover.join(10)
        _same(store, pub, index)
        assert index.blocks("node-t", "STORAGE") == set()  # the deleted SSD copy is withdrawn
    finally:
        index.close()
        pub.close()
        store.close(flush=False)
