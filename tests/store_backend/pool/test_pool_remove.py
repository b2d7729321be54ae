"""The pool-wide remove rule on the node side (docs/design/POOL.md, the directory's remove rule):
in-process nodes made of real TieredStores, PoolTiers, Registrars and real TCP transports, over the
embedded directory or a real redis-server.

- residency events carry their commit time (``at_s``), and the registrar registers with it, so a
  fresh put after a remove is visible again, while a copy committed before the remove is refused
  and deleted locally;
- ``PoolTier.remove`` asks every live node (a registration still on its way is deleted too), also
  while the tier backs off after a directory blip; a node that did not confirm answers IO_ERROR
  and is retried in the background; during an outage it answers IO_ERROR at once;
- the replicator never records a peer's EXISTS as a replica;
- one caller at a time probes a mute directory;
- the heartbeat tells the location cache of dead nodes and prunes long-dead ones;
- a Redis that restarted empty gets its tombstones back from the nodes that made or received the
  removes, so a node that was away still has its old copy refused.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import xxhash

from store_backend.pool.cache import CachedDirectory
from store_backend.pool.directory import Directory, DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.directory_redis import RedisDirectory
from store_backend.pool.registrar import Registrar, node_info
from store_backend.pool.replicator import Replicator
from store_backend.pool.service import local_view
from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_server import TcpTransportServer
from store_backend.pool.tier import PoolTier
from store_backend.residency import ResidencyEvent
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.pool.redis_server import RedisProcess
from tests.store_backend.pool.transport_helpers import SECRET, payload, wait_for

MiB = 1 << 20
SIZE = 64 << 10


class Node:
    """One pool node in this process: store (+ PoolTier), TCP server, client, registrar."""

    def __init__(self, node_id: str, directory: Directory, *, registrar: bool = True, dram: int = 16 * MiB,
                 transport: Any = None, **tier_kw: Any) -> None:
        self.node_id, self.directory = node_id, directory
        self.tier = PoolTier(node_id, timeout_s=5.0, **tier_kw)
        self.store = TieredStore({"dram": {"capacity_bytes": dram, "shm_name": f"mkv-pr-{uuid.uuid4().hex[:10]}"}},
                                 tiers=[self.tier], fresh_segment=True).start()
        served = local_view(self.store, self.tier)
        self.server = TcpTransportServer(served, SECRET)
        self.server.start()
        self.transport = transport if transport is not None else TcpTransport(SECRET)
        directory.heartbeat(node_info(self.store, node_id, self.server.address, 1), 60.0)  # capacity: a target
        self.tier.bind(directory, self.transport)
        self.reg: Registrar | None = None
        if registrar:
            self.reg = Registrar(self.store, directory, node_id,
                                 info=lambda: node_info(self.store, node_id, self.server.address, 1),
                                 heartbeat_s=0.1, node_ttl_s=60.0, pull_margin_s=5.0,
                                 peer_put=served.take_peer_put, remove_log=self.tier.remove_log,
                                 on_restored=self.tier.owe_removes).start()
            served.committed_after = self.reg.committed_after  # as PoolService wires it

    def close(self) -> None:
        if self.reg is not None:
            self.reg.close()
        self.server.close()
        self.tier.close()
        self.transport.close()
        self.store.close(flush=False)


@pytest.fixture
def nodes() -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(*args: Any, **kw: Any) -> Node:
        made.append(Node(*args, **kw))
        return made[-1]

    yield make
    for n in reversed(made):
        n.close()


def _locs(d: Directory, key: str) -> list[tuple[str, str]]:
    return [(loc.node, loc.tier) for loc in d.locate([key])[0]]


# -- the commit time ------------------------------------------------------------------------------------

def test_residency_events_carry_their_commit_time() -> None:
    store = TieredStore({"dram": {"capacity_bytes": 4 * MiB}}).start()
    got: list[ResidencyEvent] = []
    store.subscribe(got.extend)
    try:
        before = time.time()
        assert store.put(["t"], [payload("t", SIZE)]) == [Status.OK]
        assert wait_for(lambda: bool(got))
        assert got[0].kind == "stored" and before <= got[0].at_s <= time.time(), got
    finally:
        store.close(flush=False)


def test_a_fresh_put_after_a_remove_is_visible_again(nodes: Callable[..., Node]) -> None:
    """Transport review F8: the registrar passed no stored_at_s, so every later put of a removed key
    was refused (for the tombstone's 24 h) and still counted as registered."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    b, c = nodes("B", d), nodes("C", d)
    k = "again/1"
    assert b.store.put([k], [payload(k, SIZE)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    assert c.store.remove([k]) == [Status.OK]
    assert b.store.tier_of([k], local_only=True) == [None]
    time.sleep(0.2)  # past clock_skew_s: the new put is clearly newer than the remove
    v2 = payload("v2", SIZE)
    assert b.store.put([k], [v2]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")]), (_locs(d, k), b.reg.counters)
    buf = bytearray(SIZE)
    assert c.store.get_into([k], [buf])[0].status is Status.OK
    assert bytes(buf) == v2.tobytes()
    assert b.reg.counters["refused_registrations"] == 0


def test_a_copy_moved_after_a_remove_that_missed_it_is_refused_and_deleted(
        make_directory_for: Callable[..., Directory], tmp_path: Any) -> None:
    """Directory review 1 (r1 case A, embedded and Redis): the remove's transport call to N failed,
    then N demoted its copy: the re-registration cleared the tombstone (or, refused, the copy stayed
    on N for its own engines)."""
    d = make_directory_for(clock_skew_s=0.05)
    store = TieredStore({"dram": {"capacity_bytes": 2 * MiB},
                         "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB}}).start()
    reg = Registrar(store, d, "N", info=lambda: node_info(store, "N", "127.0.0.1:1", 1), heartbeat_s=0.1,
                    node_ttl_s=5.0).start()
    try:
        assert store.put(["k0"], [payload("k0", 256 << 10)]) == [Status.OK]
        assert wait_for(lambda: _locs(d, "k0") == [("N", "dram")], 10)
        assert d.remove(["k0"]) == {"k0": ["N"]}  # as a pool-wide remove whose call to N failed
        for i in range(12):  # more than DRAM holds: k0 is demoted to SSD (a "moved" event)
            assert store.put([f"m{i}"], [payload(f"m{i}", 256 << 10)]) == [Status.OK]
            assert store.flush(timeout_s=30)
        assert wait_for(lambda: store.tier_of(["k0"], local_only=True) == [None], 10), \
            (store.tier_of(["k0"], local_only=True), reg.counters)
        assert reg.wait_idle(10)
        assert _locs(d, "k0") == []
        assert reg.counters["refused_registrations"] >= 1
    finally:
        reg.close()
        store.close(flush=False)


class _HookedTransport(TcpTransport):
    """Fault injection (timing only): ``hook`` runs once right after a get returned its bytes."""

    hook: Callable[[], None] | None = None

    def get_into(self, *a: Any, **kw: Any) -> Any:
        got = super().get_into(*a, **kw)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return got


def test_a_remote_read_racing_a_remove_keeps_no_copy(nodes: Callable[..., Node]) -> None:
    """Transport review F1 (r1_remove_resurrect): C's remove ran while A's read of K from B was in
    flight; A kept the removed bytes as a local copy and served them to its own engines."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    ta = _HookedTransport(SECRET)
    a, b, c = nodes("A", d, transport=ta), nodes("B", d), nodes("C", d)
    k, size = "race/1", 1 * MiB
    assert b.store.put([k], [payload(k, size)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    time.sleep(0.1)  # past clock_skew_s: the remove is clearly later than the put
    removed: dict[str, Any] = {}
    ta.hook = lambda: removed.setdefault("st", c.store.remove([k]))
    assert a.store.get_into([k], [bytearray(size)])[0].status is Status.OK  # read before the remove
    assert removed["st"] == [Status.OK]
    assert wait_for(lambda: a.store.tier_of([k], local_only=True) == [None], 10)
    for n in (a, b, c):
        assert n.reg is not None and n.reg.wait_idle(5)
    assert _locs(d, k) == []
    for n in (a, b, c):
        assert n.store.get_into([k], [bytearray(size)])[0].status is Status.NOT_FOUND, n.node_id


def test_a_pull_in_flight_when_its_reads_are_invalidated_keeps_no_copy(nodes: Callable[..., Node]) -> None:
    """A retried remove that keeps this node's newer copy of K invalidates the reads of K in flight
    (``TieredStore.invalidate_reads``): a pull of the older bytes from a holder the remove has not
    reached yet, begun before, must not be kept (beside the newer copy, or after it left)."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    ta = _HookedTransport(SECRET)
    a, b = nodes("A", d, transport=ta), nodes("B", d)
    k, size = "inflight/1", 256 << 10
    assert b.store.put([k], [payload(k, size)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    ta.hook = lambda: a.store.invalidate_reads([k])
    buf = bytearray(size)
    assert a.store.get_into([k], [buf])[0].status is Status.OK  # the read itself began before
    assert bytes(buf) == payload(k, size).tobytes()
    assert a.store.tier_of([k], local_only=True) == [None]  # but no copy of it was kept
    # A read that is not invalidated keeps its copy, as before.
    assert a.store.get_into([k], [bytearray(size)])[0].status is Status.OK
    assert wait_for(lambda: a.store.tier_of([k], local_only=True) == ["dram"], 10)


class _LostInvalidations:
    """Fault injection: a directory whose invalidations never reach the subscriber (Redis pub/sub
    is at-most-once); everything else is ``inner``'s."""

    def __init__(self, inner: Directory) -> None:
        self.inner = inner

    def subscribe(self, fn: Callable[[list[str]], None]) -> Callable[[], None]:
        return lambda: None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _HeldRemoves(TcpTransport):
    """Fault injection (timing only): removes sent to ``held`` wait for ``release``; ``sent`` is
    set once every other peer's remove returned."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.held = ""
        self.others = 0
        self.release, self.sent = threading.Event(), threading.Event()
        self._done = 0
        self._lock = threading.Lock()

    def remove(self, address: str, keys: Any, **kw: Any) -> Any:
        if address == self.held:
            self.release.wait(30)
            return super().remove(address, keys, **kw)
        got = super().remove(address, keys, **kw)
        with self._lock:
            self._done += 1
            if self._done == self.others:
                self.sent.set()
        return got


def test_a_node_that_confirmed_a_remove_does_not_pull_the_key_back_through_its_cache(
        nodes: Callable[..., Node]) -> None:
    """A's location cache still names B for K and the invalidation of C's remove never reaches it.
    C's remove reaches A first (A confirms: it holds nothing) and B later; A's read of K in between
    used to pull K from B, which still held it, and A kept that copy: once the remove had returned,
    A served the removed bytes. A peer's remove now drops the keys from the node's cache, so A's
    read finds no location. (A runs no registrar: no refusal comes to delete a copy it took.)"""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    cached = CachedDirectory(_LostInvalidations(d), close_inner=False)
    tc = _HeldRemoves(SECRET)
    a = nodes("A", cached, registrar=False)
    b, c = nodes("B", d), nodes("C", d, transport=tc)
    k, size = "cached/1", 256 << 10
    data = payload(k, size)
    assert b.store.put([k], [data]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    assert [(loc.node, loc.tier) for loc in cached.locate([k])[0]] == [("B", "dram")]  # now cached
    tc.held, tc.others = b.server.address, 1  # the live peers C asks: A, then B (held)
    removed: dict[str, Any] = {}
    remover = threading.Thread(target=lambda: removed.setdefault("st", c.store.remove([k])))
    remover.start()
    try:
        assert tc.sent.wait(10), "C's remove never reached A"
        buf = bytearray(size)
        during = a.store.get_into([k], [buf])[0].status  # overlaps the remove: old bytes or a miss
        assert during is Status.NOT_FOUND or bytes(buf) == bytes(data), during
    finally:
        tc.release.set()
        remover.join(30)
    assert removed["st"] == [Status.OK]
    for n in (a, b, c):
        buf = bytearray(size)
        assert n.store.get_into([k], [buf])[0].status is Status.NOT_FOUND, n.node_id
    assert a.store.tier_of([k], local_only=True) == [None]


class _HeldPut(TcpTransport):
    """Fault injection (timing only): a put waits until ``go`` (the replicator has leased the
    bytes by then); ``entered`` when it is called, ``done`` when it returned."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.entered, self.go, self.done = threading.Event(), threading.Event(), threading.Event()

    def put(self, *a: Any, **kw: Any) -> Any:
        self.entered.set()
        self.go.wait(30)
        try:
            return super().put(*a, **kw)
        finally:
            self.done.set()


class _RegisterDown:
    """Fault injection: while ``down``, this node's registrations find the directory unreachable
    (so no refusal comes to delete a copy it took); everything else is ``inner``'s."""

    def __init__(self, inner: Directory) -> None:
        self.inner, self.down = inner, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register(self, *a: Any, **kw: Any) -> Any:
        if self.down:
            raise DirectoryUnavailable("injected: the directory is unreachable from this node")
        return self.inner.register(*a, **kw)


@pytest.mark.parametrize("target_registers", [True, False], ids=["target-registers", "target-cut-off"])
def test_a_replica_sent_before_a_remove_does_not_land_after_it(
        nodes: Callable[..., Node], target_registers: bool) -> None:
    """replicas 2: A's replicator leased K's bytes for B, then A removes K (B confirms: it holds
    nothing yet), then the replica's put reaches B. B used to commit it and serve the removed
    bytes to its engines until its registration was refused (for as long as it could not reach the
    directory). A peer's put of a key a peer removed within twice timeout_s is now refused."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    bdir = _RegisterDown(d)
    a, b = nodes("A", d), nodes("B", bdir)
    k, size = "replica-after-remove/1", 256 << 10
    data = payload(k, size)
    held = _HeldPut(SECRET)
    rep = Replicator(a.store, d, held, "A", 2, timeout_s=5.0).start()
    try:
        assert a.store.put([k], [data]) == [Status.OK]
        assert wait_for(lambda: _locs(d, k) == [("A", "dram")])
        rep.offer([(k, size, time.time())])
        assert held.entered.wait(10)  # put_start done, K leased on A
        bdir.down = not target_registers
        assert a.store.remove([k]) == [Status.OK]
        held.go.set()  # the replica, under way since before the remove, reaches B
        assert held.done.wait(10)
        for n in (a, b):
            buf = bytearray(size)
            assert n.store.get_into([k], [buf])[0].status is Status.NOT_FOUND, n.node_id
        assert b.store.tier_of([k], local_only=True) == [None]
        assert _locs(d, k) == []
        assert rep.counters["replicas_sent"] == 0
    finally:
        held.go.set()
        bdir.down = False
        rep.close()


class _CutOff:
    """Fault injection: while ``down``, every call of this node to the directory raises (it cannot
    reach Redis; its transport and its engines still work)."""

    def __init__(self, inner: Directory) -> None:
        self.inner, self.down = inner, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "subscribe":
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            if self.down:
                raise DirectoryUnavailable("injected: cut off from the directory")
            return attr(*a, **kw)
        return call


def test_a_holder_counted_dead_but_reachable_is_asked_to_remove(nodes: Callable[..., Node]) -> None:
    """B holds K and loses the directory (not its peers) for longer than its liveness TTL: the
    directory counts it dead. A's remove used to skip it and answer OK while B's engines went on
    reading the removed bytes. A dead holder is now asked too, for the keys listed on it."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    cut = _CutOff(d)
    a = nodes("A", d)
    b = nodes("B", cut, registrar=False)
    d.heartbeat(node_info(b.store, "B", b.server.address, 1), 0.5)  # B's mark: 0.5 s from now
    reg = Registrar(b.store, cut, "B", info=lambda: node_info(b.store, "B", b.server.address, 1),
                    heartbeat_s=0.1, node_ttl_s=0.5, pull_margin_s=5.0).start()
    try:
        k, size = "dead-holder/1", 64 << 10
        assert b.store.put([k], [payload(k, size)]) == [Status.OK]
        assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
        cut.down = True
        assert wait_for(lambda: not {n.node_id: n.alive for n in d.nodes()}["B"], 5)
        assert a.store.remove([k]) == [Status.OK]
        buf = bytearray(size)
        assert b.store.get_into([k], [buf])[0].status is Status.NOT_FOUND
    finally:
        cut.down = False
        reg.close()


def test_a_dead_holder_that_does_not_answer_makes_the_remove_io_error_and_is_retried(
        nodes: Callable[..., Node]) -> None:
    """B holds K, stops answering (its server closed) and goes dead in the directory: A's remove
    cannot know whether B still serves K, so it answers IO_ERROR and retries B in the
    background; B's copy is refused by the tombstone when it registers again."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    a = nodes("A", d)
    b = nodes("B", d, registrar=False)
    d.heartbeat(node_info(b.store, "B", b.server.address, 1), 0.5)
    k, size = "dead-holder/2", 64 << 10
    assert b.store.put([k], [payload(k, size)]) == [Status.OK]
    d.register("B", [(k, Location("B", "dram", size, 0))])
    b.server.close()
    assert wait_for(lambda: not {n.node_id: n.alive for n in d.nodes()}["B"], 5)
    assert a.store.remove([k]) == [Status.IO_ERROR]
    assert wait_for(lambda: a.tier.extra_stats().get("remove_retries", 0) >= 1, 10)
    assert _locs(d, k) == []
    # B never answers: the key stays owed (queued, or being tried), counted in the queue gauge.
    assert a.store.stats().queues.pool_remove == 1


class _SlowRegister:
    """Fault injection: this node's registrations arrive ``delay_s`` late (a loaded registrar)."""

    def __init__(self, inner: Directory, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def register(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        time.sleep(self._delay_s)  # the simulated slow registration
        return self._inner.register(*args, **kw)


def test_a_registration_in_flight_during_a_remove_is_deleted_and_stays_refused(
        nodes: Callable[..., Node]) -> None:
    """Directory review 2 (r6): R removed K while N's registration was on its way: R was told
    NOT_FOUND and K came back pool-wide with the removed bytes."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    slow = _SlowRegister(d, 0.5)
    n, r = nodes("N", slow), nodes("R", d)
    assert n.reg is not None and n.reg.wait_idle(10)
    k = "inflight/1"
    slow.entered.clear()
    assert n.store.put([k], [payload(k, SIZE)]) == [Status.OK]
    assert slow.entered.wait(5)
    time.sleep(0.1)  # the put was committed clearly before the remove
    assert r.store.remove([k]) == [Status.OK]  # N was asked too, though not yet listed
    assert n.store.tier_of([k], local_only=True) == [None]
    assert n.reg.wait_idle(10)
    assert _locs(d, k) == []
    assert r.store.get_into([k], [bytearray(SIZE)])[0].status is Status.NOT_FOUND


def test_a_remove_during_the_back_off_still_reaches_every_holder(nodes: Callable[..., Node]) -> None:
    """Transport review F2 (r5): one directory blip left C backing off; its remove skipped every
    holder's address and answered OK while B kept (and served) the removed bytes."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    b = nodes("B", d)
    blip = {"n": 1}

    class Blip:
        def __getattr__(self, name: str) -> Any:
            return getattr(d, name)

        def locate(self, *a: Any, **kw: Any) -> Any:
            if blip["n"]:
                blip["n"] -= 1
                raise DirectoryUnavailable("injected")
            return d.locate(*a, **kw)

    c = nodes("C", Blip(), registrar=False, retry_after_s=1.0)
    assert c.tier.remove(["warm"]) == [Status.NOT_FOUND]  # nothing to back off from yet
    k = "blip/1"
    assert b.store.put([k], [payload(k, SIZE)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    assert c.store.get_into(["other"], [bytearray(SIZE)])[0].status is Status.NOT_FOUND  # the blip
    assert blip["n"] == 0
    # Backing off: the remove is not half done (OK while B kept the bytes), it answers IO_ERROR.
    assert c.tier.remove([k]) == [Status.IO_ERROR]
    assert _locs(d, k) == [("B", "dram")]
    time.sleep(1.1)  # the back-off over: the next call probes the directory
    assert c.tier.remove([k]) == [Status.OK]
    assert b.store.tier_of([k], local_only=True) == [None]
    assert b.store.get_into([k], [bytearray(SIZE)])[0].status is Status.NOT_FOUND


class _FailRemovesTo:
    """Fault injection: the first ``n`` removes sent to ``address`` fail (a peer that does not answer)."""

    def __init__(self, inner: TcpTransport, address: str, n: int) -> None:
        self._inner, self._address, self.left = inner, address, n
        self.removes: list[tuple[str, list[str]]] = []
        self.answered: list[tuple[list[str], float, list[Status]]] = []  # (keys, before_s, statuses) at address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def remove(self, address: str, keys: Any, **kw: Any) -> list[Status]:
        self.removes.append((address, list(keys)))
        if address == self._address and self.left:
            self.left -= 1
            return [Status.IO_ERROR] * len(keys)
        got = self._inner.remove(address, keys, **kw)
        if address == self._address:
            self.answered.append((list(keys), kw.get("before_s", 0.0), got))
        return got


def test_a_live_node_that_does_not_confirm_gets_io_error_and_a_retry(nodes: Callable[..., Node]) -> None:
    """REMOVE_RULE: a live holder that did not answer: IO_ERROR to the caller, and the remove is
    retried in the background until the holder confirms (r12: B's copy stayed, served for good)."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    b = nodes("B", d)
    flaky = _FailRemovesTo(TcpTransport(SECRET), b.server.address, 2)
    c = nodes("C", d, registrar=False, transport=flaky, retry_after_s=0.2)
    k = "retry/1"
    assert b.store.put([k], [payload(k, SIZE)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, k) == [("B", "dram")])
    assert c.tier.remove([k]) == [Status.IO_ERROR]
    assert b.store.tier_of([k], local_only=True) == ["dram"]  # not yet
    assert wait_for(lambda: b.store.tier_of([k], local_only=True) == [None], 10), flaky.removes
    assert [a for a, _k in flaky.removes].count(b.server.address) == 3  # the remove, a failed retry, one that did
    assert b.reg is not None and b.reg.wait_idle(5)
    assert _locs(d, k) == []


def test_a_retried_remove_keeps_a_put_made_on_the_node_since_and_deletes_older_copies(
        nodes: Callable[..., Node]) -> None:
    """Review of the remove rule: the retry of a remove B did not confirm used to delete whatever B
    held under the key when it finally answered, a put made on B after the remove included (a
    miss for every engine). Now the retry carries the remove's time: B keeps a copy it knows was
    committed after it, and still deletes a copy from before it."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    b = nodes("B", d, clock_skew_s=0.05)
    flaky = _FailRemovesTo(TcpTransport(SECRET), b.server.address, 10 ** 6)
    c = nodes("C", d, registrar=False, transport=flaky, retry_after_s=0.2, clock_skew_s=0.05)
    fresh, old = "retry/fresh", "retry/old"
    for k in (fresh, old):
        assert b.store.put([k], [payload(k, SIZE)]) == [Status.OK]
    assert wait_for(lambda: _locs(d, fresh) == [("B", "dram")] and _locs(d, old) == [("B", "dram")])
    t_remove = time.time()
    assert c.tier.remove([fresh, old]) == [Status.IO_ERROR, Status.IO_ERROR]  # B does not answer
    # On B, ``fresh``'s old copy goes (an eviction would do the same) and an engine puts it anew
    # after the remove: the directory accepts the new copy (committed after the tombstone).
    assert b.store.remove([fresh], local_only=True) == [Status.OK]
    time.sleep(0.2)  # past clock_skew_s
    v2 = payload("v2", SIZE)
    assert b.store.put([fresh], [v2]) == [Status.OK]
    assert wait_for(lambda: _locs(d, fresh) == [("B", "dram")]), b.reg.counters
    assert b.reg.committed_after([fresh, old, "never/stored"], t_remove) == [True, False, False]
    # Both keys are owed a retry while B does not answer (the gauge operators see).
    assert c.store.stats().queues.pool_remove == 2
    assert c.tier.gauges().owed_removes == 2
    assert node_info(c.store, "C", c.server.address, 1).counters["queue_pool_remove"] == 2  # status --pool
    flaky.left = 0  # B answers again: the retry reaches it
    assert wait_for(lambda: any(old in keys for keys, _t, _st in flaky.answered), 10), flaky.removes
    assert wait_for(lambda: c.store.stats().queues.pool_remove == 0, 10)  # B confirmed both: nothing owed
    keys, before_s, got = next(a for a in flaky.answered if old in a[0])
    assert t_remove <= before_s <= t_remove + 1.0  # the remove's own time, not the retry's
    assert dict(zip(keys, got)) == {fresh: Status.NOT_FOUND, old: Status.OK}
    assert b.store.tier_of([fresh, old], local_only=True) == ["dram", None]
    buf = bytearray(SIZE)
    assert c.store.get_into([fresh], [buf])[0].status is Status.OK and bytes(buf) == v2.tobytes()
    assert c.store.get_into([old], [bytearray(SIZE)])[0].status is Status.NOT_FOUND


def test_a_live_holder_without_an_address_is_io_error(nodes: Callable[..., Node]) -> None:
    """Transport review F2: a holder the directory lists, alive but with no address, was skipped (OK)."""
    d = EmbeddedDirectory()
    c = nodes("C", d, registrar=False)
    d.heartbeat(NodeInfo("X", ""), 60.0)
    d.register("X", [("noaddr", Location("X", "dram", SIZE))])
    assert c.tier.remove(["noaddr"]) == [Status.IO_ERROR]


def test_a_remove_during_an_outage_answers_io_error_at_once() -> None:
    """Transport review F6 (r10): every remove stalled op_timeout_s while Redis was mute."""
    with RedisProcess() as rp:
        d = RedisDirectory(url=rp.url, namespace="rm6", op_timeout_s=0.5)
        tier = PoolTier("A", retry_after_s=5.0)
        tier.bind(d, TcpTransport(SECRET))
        try:
            d.heartbeat(NodeInfo("A", "127.0.0.1:1"), 30)
            os.kill(rp.proc.pid, signal.SIGSTOP)
            try:
                took = []
                for _ in range(4):
                    t0 = time.monotonic()
                    assert tier.remove(["x"]) == [Status.IO_ERROR]
                    took.append(time.monotonic() - t0)
            finally:
                os.kill(rp.proc.pid, signal.SIGCONT)
            assert took[0] >= 0.4 and max(took[1:]) < 0.1, took
            assert tier.extra_stats()["failures_directory"] >= 4
        finally:
            tier.close()
            d.close()


# -- the replicator ---------------------------------------------------------------------------------------

def test_a_peers_exists_is_not_recorded_as_a_replica(nodes: Callable[..., Node]) -> None:
    """Directory review 3 (r9): B held an older object under K; A's replica write got EXISTS and
    recorded B with checksum 0, and a reader got B's old bytes with status OK."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    a, b = nodes("A", d), nodes("B", d, registrar=False)
    k = "rep/1"
    v1, v2 = payload("v1", SIZE), payload("v2", SIZE)
    assert b.store.put([k], [v1]) == [Status.OK]  # not in the directory
    rep = Replicator(a.store, d, a.transport, "A", 2, timeout_s=5.0).start()
    try:
        assert a.store.put([k], [v2]) == [Status.OK]
        assert wait_for(lambda: _locs(d, k) == [("A", "dram")])
        rep.offer([(k, SIZE, time.time())])
        assert rep.wait_idle(10)
        locs = d.locate([k])[0]
        assert [loc.node for loc in locs] == ["A"], locs
        assert rep.counters["replicas_sent"] == 0 and rep.counters["replicas_failed"] == 1, rep.counters
        r = nodes("R", d, registrar=False)
        buf = bytearray(SIZE)
        assert r.store.get_into([k], [buf])[0].status is Status.OK
        assert bytes(buf) == v2.tobytes()
    finally:
        rep.close()


def test_a_replica_is_recorded_with_its_real_checksum(nodes: Callable[..., Node]) -> None:
    d = EmbeddedDirectory(clock_skew_s=0.05)
    a, _b = nodes("A", d), nodes("B", d, registrar=False)
    k = "rep/2"
    v = payload(k, SIZE)
    rep = Replicator(a.store, d, a.transport, "A", 2, timeout_s=5.0).start()
    try:
        assert a.store.put([k], [v]) == [Status.OK]
        assert wait_for(lambda: _locs(d, k) == [("A", "dram")])
        rep.offer([(k, SIZE, time.time())])
        assert rep.wait_idle(10)
        sums = {loc.node: loc.checksum for loc in d.locate([k])[0]}
        assert sums == {"A": xxhash.xxh3_64_intdigest(v.tobytes()), "B": xxhash.xxh3_64_intdigest(v.tobytes())}
    finally:
        rep.close()


def test_a_replica_that_lands_after_a_remove_is_refused_on_its_target(nodes: Callable[..., Node]) -> None:
    """A replica write whose source was read before a pool-wide remove, committed on its target
    after it: the target's registrar registered it with its own commit time (newer than the remove)
    and the removed bytes were listed again."""
    d = EmbeddedDirectory(clock_skew_s=0.05)
    a, b = nodes("A", d, registrar=False), nodes("B", d)
    k = "late-replica/1"
    assert d.put_start("B", [k], [SIZE], ttl_s=10.0) == [True]  # the replicator's phase 1
    d.remove([k])  # the pool-wide remove, while the bytes are on their way
    time.sleep(0.1)  # past clock_skew_s: the replica lands clearly after the remove
    assert a.transport.put(b.server.address, [k], [payload(k, SIZE)], timeout_s=5.0) == [Status.OK]
    assert wait_for(lambda: b.store.tier_of([k], local_only=True) == [None], 10), b.reg.counters
    assert b.reg is not None and b.reg.wait_idle(5)
    assert _locs(d, k) == []
    assert b.reg.counters["refused_registrations"] == 1


# -- a mute directory ---------------------------------------------------------------------------------------

class _NoTransport:
    def stats(self) -> dict[str, int]:
        return {}


def test_one_caller_at_a_time_probes_a_mute_redis() -> None:
    """Directory review 7 (r4): with Redis SIGSTOPped every engine thread inside the tier stalled
    op_timeout_s once per retry_after_s; now one probe is in flight, the others miss at once."""
    with RedisProcess() as rp:
        raw = RedisDirectory(url=rp.url, namespace="r4", op_timeout_s=0.5)
        d = CachedDirectory(raw)
        tier = PoolTier("A", retry_after_s=0.3)
        tier.bind(d, _NoTransport())  # type: ignore[arg-type]
        try:
            d.heartbeat(NodeInfo("A", "127.0.0.1:1"), 30)
            assert tier.contains(["warm"]) == [False]
            lat: list[tuple[float, float]] = []
            lock = threading.Lock()
            os.kill(rp.proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            end = start + 4.0

            def worker(i: int) -> None:
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    assert tier.contains([f"k{i}-{time.monotonic_ns()}"]) == [False]
                    with lock:
                        lat.append((t0, time.monotonic() - t0))
                    time.sleep(0.01)  # the prober's pace

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            finally:
                os.kill(rp.proc.pid, signal.SIGCONT)
            # After the first second (calls already in flight when Redis went mute are excused),
            # one slow call per probe period (0.3 s back-off + 0.5 s probe) at most.
            slow_later = [dt for t0, dt in lat if t0 > start + 1.0 and dt > 0.1]
            assert len(slow_later) <= 6, (len(slow_later), len(lat))
            assert len(lat) > 100
        finally:
            tier.close()
            d.close()


# -- the heartbeat and dead nodes ------------------------------------------------------------------------

def test_the_heartbeat_forgets_a_dead_nodes_cached_locations_and_prunes_it() -> None:
    """Directory review 10/11 (r5): the cache returned a dead node's locations for cache_ttl_s;
    and nothing pruned a node dead for good."""
    inner = EmbeddedDirectory()
    cache = CachedDirectory(inner, cache_ttl_s=60.0)
    store = TieredStore({"dram": {"capacity_bytes": 4 * MiB}}).start()
    inner.heartbeat(NodeInfo("B", "127.0.0.1:9"), 0.5)
    inner.register("B", [("bk", Location("B", "dram", SIZE))])
    assert [loc.node for loc in cache.locate(["bk"])[0]] == ["B"]  # cached
    reg = Registrar(store, cache, "A", info=lambda: node_info(store, "A", "127.0.0.1:1", 1), heartbeat_s=0.1,
                    node_ttl_s=5.0, dead_node_gc_s=1.0, gc_every_s=0.2).start()
    try:
        assert wait_for(lambda: cache.locate(["bk"]) == [[]], 3), cache.locate(["bk"])
        assert wait_for(lambda: "B" not in {n.node_id for n in inner.nodes()}, 5), inner.nodes()
        assert reg.counters["pruned_nodes"] == 1
    finally:
        reg.close()
        store.close(flush=False)


# -- a directory that lost its tombstones ---------------------------------------------------------------

def test_a_redis_restarted_empty_gets_the_tombstones_back_from_the_remover_and_the_holder(
        redis_server: RedisProcess, nodes: Callable[..., Node]) -> None:
    """A Redis without persistence restarted empty lost the tombstones: a node that was away
    during a remove (its SSD copy recovered) could list its old copy again, and every engine
    would be served the removed bytes. Each node remembers the removes it made (C) or was asked
    to make (B); the resync its heartbeat starts after the loss gives them back before anything
    of its own is registered. Over the tombstone's lifetime, a late registration of a copy
    committed before the remove is refused; a key nobody removed, or put again after, is not."""
    d = CachedDirectory(RedisDirectory(url=redis_server.url, namespace="tb1", op_timeout_s=0.5,
                                      clock_skew_s=0.05), cache_ttl_s=0.2)
    b, c = nodes("B", d, clock_skew_s=0.05), nodes("C", d, clock_skew_s=0.05)
    gone = ["tb/0", "tb/1"]
    t_put = time.time()
    assert b.store.put(gone, [payload(k, SIZE) for k in gone]) == [Status.OK] * 2
    assert wait_for(lambda: all(_locs(d, k) == [("B", "dram")] for k in gone))
    time.sleep(0.2)  # the remove is clearly later than the put
    assert c.store.remove(gone[:1]) == [Status.OK]  # C made this remove, B (every live peer) was asked
    assert b.store.remove(gone[1:]) == [Status.OK]  # and B this one
    assert sorted(c.tier.remove_log.live()[0]) == gone and sorted(b.tier.remove_log.live()[0]) == gone
    raw = redis.Redis.from_url(redis_server.url)
    try:
        resyncs = (b.reg.counters["resyncs"], c.reg.counters["resyncs"])
        redis_server.restart_empty()
        assert wait_for(lambda: raw.exists(*(f"tb1:t:{k}" for k in gone)) == 2, 10), \
            (b.reg.counters, c.reg.counters)
        assert wait_for(lambda: b.reg.counters["resyncs"] > resyncs[0] and c.reg.counters["resyncs"] > resyncs[1], 10)
        assert b.reg.counters["restored_tombstones"] + c.reg.counters["restored_tombstones"] == 2  # one each
        # A node that was away comes back with its copies, committed with B's, and a key never removed.
        d.heartbeat(NodeInfo("Z", "127.0.0.1:9"), 60.0)
        old = [(k, Location("Z", "ssd", SIZE)) for k in [*gone, "tb/kept"]]
        assert d.register("Z", old, stored_at_s=[t_put] * 3) == gone
        assert _locs(d, "tb/kept") == [("Z", "ssd")] and all(_locs(d, k) == [] for k in gone)
        # A fresh put of a removed key, committed after the remove, is stored and listed as usual.
        time.sleep(0.2)  # past clock_skew_s: clearly newer than the remove
        assert c.store.put(gone[:1], [payload("v2", SIZE)]) == [Status.OK]
        assert wait_for(lambda: _locs(d, gone[0]) == [("C", "dram")]), c.reg.counters
    finally:
        raw.close()


def test_an_old_copy_listed_before_the_tombstone_came_back_is_dropped_and_deleted_on_its_node(
        redis_server: RedisProcess, nodes: Callable[..., Node]) -> None:
    """Review of the tombstone restore: a node that was away (Z) re-registered its old copy after
    Redis restarted empty and before any node that remembers the remove gave the tombstone back.
    The restore only refused later registrations, so the copy stayed listed and every node read
    the removed bytes. Now the restore drops what was listed meanwhile and has its holder delete
    it (as a retried remove); a key nobody removed stays."""
    d = CachedDirectory(RedisDirectory(url=redis_server.url, namespace="tb2", op_timeout_s=0.5,
                                      clock_skew_s=0.05), cache_ttl_s=0.2)
    z = nodes("Z", d, clock_skew_s=0.05)
    b = nodes("B", d, registrar=False, clock_skew_s=0.05, retry_after_s=0.2)  # its registrar comes later
    flaky = _FailRemovesTo(TcpTransport(SECRET), z.server.address, 10 ** 6)  # Z does not answer removes
    c = nodes("C", d, registrar=False, transport=flaky, clock_skew_s=0.05)
    k, kept = "tb2/old", "tb2/kept"
    assert z.store.put([k, kept], [payload(k, SIZE), payload(kept, SIZE)]) == [Status.OK] * 2
    assert wait_for(lambda: _locs(d, k) == [("Z", "dram")] and _locs(d, kept) == [("Z", "dram")])
    time.sleep(0.2)  # past clock_skew_s: the remove is clearly later than the put
    assert c.tier.remove([k]) == [Status.IO_ERROR]  # B confirmed; Z, the holder, did not
    assert b.tier.remove_log.live()[0] == [k] and z.store.tier_of([k], local_only=True) == ["dram"]
    c.tier.close()  # the remover goes away, and its retry with it
    redis_server.restart_empty()
    # Z's heartbeat finds it unknown and resyncs first: its old copy is listed, no tombstone to refuse it.
    assert wait_for(lambda: _locs(d, k) == [("Z", "dram")], 10), z.reg.counters
    b.reg = Registrar(b.store, d, "B", info=lambda: node_info(b.store, "B", b.server.address, 1), heartbeat_s=0.1,
                      node_ttl_s=60.0, remove_log=b.tier.remove_log, on_restored=b.tier.owe_removes).start()
    assert wait_for(lambda: b.reg.counters["restored_tombstones"] == 1, 10), b.reg.counters
    assert _locs(d, k) == []
    assert wait_for(lambda: z.store.tier_of([k], local_only=True) == [None], 10), b.tier.extra_stats()
    assert b.store.get_into([k], [bytearray(SIZE)])[0].status is Status.NOT_FOUND
    assert z.store.get_into([k], [bytearray(SIZE)])[0].status is Status.NOT_FOUND
    assert wait_for(lambda: b.store.stats().queues.pool_remove == 0, 10)  # Z confirmed
    buf = bytearray(SIZE)
    assert b.store.get_into([kept], [buf])[0].status is Status.OK and bytes(buf) == payload(kept, SIZE).tobytes()
