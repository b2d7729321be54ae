"""A real failover: primary + replica + Sentinel on loopback; SIGKILL the primary; the same
RedisDirectory object reaches the new primary by itself, keeps what was replicated, and whatever
was lost comes back through a resync. Then the same with node services (separate processes) in a
pool: they reach the new primary by themselves and go on serving each other's objects."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import redis

from store_backend.pool.directory import DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_redis import RedisDirectory
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.pool_nodes import (
    PoolNode,
    make_payload,
    published,
    put_all,
    read_ok,
    wait_located,
    wait_nodes_alive,
)
from tests.store_backend.pool.redis_server import RedisProcess

T = TypeVar("T")
MASTER = "mymaster"
SIZE = 256 << 10


def loc(node: str) -> Location:
    return Location(node, "ssd", 10, 3)


def until(fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """Retry ``fn`` over DirectoryUnavailable, with a bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except DirectoryUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # poll interval; the loop has a deadline


def wait_link_up(replica_port: int, password: str | None, timeout_s: float = 20.0) -> None:
    r = redis.Redis(port=replica_port, password=password, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while r.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.1)  # poll interval; the loop has a deadline
    finally:
        r.close()


def wait_replicated(primary_port: int, password: str | None, timeout_s: float = 10.0) -> None:
    r = redis.Redis(port=primary_port, password=password)
    try:
        assert r.wait(1, int(timeout_s * 1000)) >= 1, "the write never reached the replica"
    finally:
        r.close()


@pytest.fixture(params=[None, "sentinel-pw"], ids=["noauth", "auth"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[RedisProcess, RedisProcess, RedisProcess]]:
    password = request.param
    with RedisProcess(password=password) as primary:
        with RedisProcess(password=password, replica_of=primary.port) as replica:
            with RedisProcess(password=password, sentinel_of=(MASTER, primary.port)) as sentinel:
                wait_link_up(replica.port, password)
                yield primary, replica, sentinel


def test_failover_the_same_object_reaches_the_new_primary(
        cluster: tuple[RedisProcess, RedisProcess, RedisProcess]) -> None:
    primary, replica, sentinel = cluster
    url = f"redis://:{primary.password}@/0" if primary.password else None
    d = RedisDirectory(url=url, sentinels=[f"127.0.0.1:{sentinel.port}"], sentinel_master=MASTER,
                       op_timeout_s=0.5)
    seen: list[str] = []
    d.subscribe(seen.extend)
    info = NodeInfo("a", "127.0.0.1:1")
    assert d.heartbeat(info, 60.0) is False
    d.register("a", [(f"k{i}", loc("a")) for i in range(100)])
    assert d.heartbeat(info, 60.0) is True
    wait_replicated(primary.port, primary.password)
    primary.kill()

    # Written after the kill, before the failover: it fails (DirectoryUnavailable, quickly);
    # the resync below restores it.
    t = time.monotonic()
    with pytest.raises(DirectoryUnavailable, match="sentinel master 'mymaster'"):
        d.register("a", [("during", loc("a"))])
    assert time.monotonic() - t < 5.0
    assert until(lambda: d.leading([f"k{i}" for i in range(100)]), timeout_s=40.0) == 100
    failover_s = time.monotonic() - t
    # Its liveness mark (ttl 60 s) and its generation were replicated before the kill, and the
    # failed write never ran: the new primary knows the node, intact, so no resync is asked for.
    assert until(lambda: d.heartbeat(info, 60.0)) is True
    assert d.locate(["k7"]) == [[loc("a")]]
    admin = redis.Redis(port=replica.port, password=primary.password, decode_responses=True)
    assert admin.info("replication")["role"] == "master"  # the object went to the new primary
    admin.close()

    # New writes and the invalidation channel work on the new primary.
    d.register("a", [("after", loc("a"))])
    assert d.locate(["after"]) == [[loc("a")]]
    deadline = time.monotonic() + 15
    while "after" not in seen and time.monotonic() < deadline:
        d.unregister("a", ["after"])  # until the subscriber has reconnected, messages are lost
        d.register("a", [("after", loc("a"))])
        time.sleep(0.1)  # poll interval; the loop has a deadline
    assert "after" in seen
    # What could not be written comes back by the caller's resync (everything it holds).
    assert d.leading(["during"]) == 0
    assert d.register("a", [(k, loc("a")) for k in ["during", *(f"k{i}" for i in range(100))]], resync=True) == []
    assert d.leading(["during", *(f"k{i}" for i in range(100))]) == 101
    d.close()
    assert failover_s < 40.0


def test_failover_node_services_reconnect_by_themselves_and_keep_serving(
        cluster: tuple[RedisProcess, RedisProcess, RedisProcess]) -> None:
    """Two node services (separate processes) address Redis through the Sentinel. A's objects,
    listed in the directory and replicated (WAIT), survive a SIGKILL of the primary with no
    directory call of the test's own: each node's heartbeat reaches the promoted replica by
    itself (the info it publishes there counts the outage it went through and a resync after
    it), the directory on the new primary lists A's objects again, B reads every one of them
    from A over the pool byte for byte (B's pool tier counts them; B held none before), and an
    object A stores after the failover is read from B the same way."""
    primary, replica, sentinel = cluster
    url = f"redis://:{primary.password}@/0" if primary.password else None
    sentinels = [f"127.0.0.1:{sentinel.port}"]
    via_sentinel = {"kind": "redis", "url": url, "sentinels": sentinels, "sentinel_master": MASTER,
                    "op_timeout_s": 0.5}
    # The test's own directory only reads (nodes, locate), through the Sentinel like the nodes.
    d = RedisDirectory(url=url, sentinels=sentinels, sentinel_master=MASTER, op_timeout_s=0.5)
    # The positional url is unused: ``directory`` replaces the whole directory section.
    a, b = (PoolNode(name, primary.url, directory=via_sentinel) for name in ("A", "B"))
    try:
        a.start()
        b.start()
        wait_nodes_alive(d, ["A", "B"])
        ca, cb = a.client(), b.client()
        keys = [f"sf-{i:02d}" for i in range(8)]
        put_all(ca, {k: make_payload(k, 1, SIZE) for k in keys})
        wait_located(d, keys, "A")
        assert set(keys).isdisjoint(cb.keys())  # B holds none of them itself
        wait_replicated(primary.port, primary.password)
        with redis.Redis(port=replica.port, password=primary.password) as r:
            assert r.exists(*(f"mkv:k:{k}" for k in keys)) == len(keys)  # A's entries are on the replica
        # What each node published last before the kill, once it counts the start's resync (a
        # node's first heartbeat may come before its registrar's counters are part of its info).
        def settled(n: str) -> dict[str, int] | None:
            got = published(d, n)
            return got if got is not None and got.get("resyncs", 0) >= 1 else None

        before = {n: wait_until(lambda n=n: settled(n), 10, f"{n}'s counters published") for n in ("A", "B")}
        hits = cb.stats().pool.hits

        primary.kill()
        t0 = time.monotonic()
        with redis.Redis(port=replica.port, password=primary.password, decode_responses=True) as r:
            wait_until(lambda: r.info("replication")["role"] == "master", 40, "the replica promoted")

        # Each node's heartbeat reached the new primary by itself: the info it published there
        # counts directory errors it met after the kill, and a resync since.
        def reconnected(n: str) -> bool:
            now = published(d, n)
            return now is not None and all(now.get(c, 0) > before[n][c] for c in ("directory_errors", "resyncs"))

        wait_until(lambda: all(reconnected(n) for n in ("A", "B")), 40, "both nodes back on the new primary")
        wait_located(d, keys, "A")
        read_ok(cb, keys, SIZE, 1)
        assert cb.stats().pool.hits - hits == len(keys)  # every one read from A over the pool
        assert cb.tier_of(keys) == ["dram"] * len(keys)  # and kept as B's own copy

        put_all(ca, {"sf-after": make_payload("sf-after", 2, SIZE)})
        wait_located(d, ["sf-after"], "A")
        read_ok(cb, ["sf-after"], SIZE, 2)
        assert cb.stats().pool.hits - hits == len(keys) + 1
        assert time.monotonic() - t0 < 60.0
    finally:
        a.close()
        b.close()
        d.close()


def test_no_sentinel_reachable_fails_fast_naming_the_sentinels() -> None:
    from tests.store_backend.pool.redis_server import free_port

    port = free_port()
    d = RedisDirectory(sentinels=[f"127.0.0.1:{port}"], op_timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(DirectoryUnavailable, match=f"sentinel master 'mymaster' via 127.0.0.1:{port}"):
        d.leading(["k"])
    assert time.monotonic() - t < 2.0
    d.close()


def test_mute_sentinels_cost_one_deadline_and_the_last_primary_is_kept() -> None:
    """Finding 6: SIGSTOPped Sentinels (a partition) used to cost 2 tries x every Sentinel x
    op_timeout_s per new connection. Now they are asked in parallel within op_timeout_s, a
    MasterNotFoundError is not retried, and a directory that knew the primary keeps using it."""
    import os
    import signal

    op_s = 0.5
    with RedisProcess() as primary:
        sentinels = [RedisProcess(sentinel_of=(MASTER, primary.port)).start() for _ in range(3)]
        addrs = [f"127.0.0.1:{s.port}" for s in sentinels]
        stopped = False
        try:
            known = RedisDirectory(sentinels=addrs, sentinel_master=MASTER, op_timeout_s=op_s, namespace="mute")
            assert until(lambda: known.heartbeat(NodeInfo("a", "h:1"), 30.0), timeout_s=10.0) is False
            known.register("a", [("k", loc("a"))])
            fresh = RedisDirectory(sentinels=addrs, sentinel_master=MASTER, op_timeout_s=op_s, namespace="mute")
            for s in sentinels:
                os.kill(s.proc.pid, signal.SIGSTOP)
            stopped = True
            for attempt in range(2):
                known._r.connection_pool.disconnect()  # the next call needs a new connection
                t = time.monotonic()
                assert known.locate(["k"]) == [[loc("a")]]
                assert time.monotonic() - t < 2 * op_s + 0.3, attempt
            t = time.monotonic()
            with pytest.raises(DirectoryUnavailable, match="sentinel master 'mymaster'"):
                fresh.locate(["k"])
            assert time.monotonic() - t < op_s + 0.4
            for s in sentinels:
                os.kill(s.proc.pid, signal.SIGCONT)
            stopped = False
            assert until(lambda: fresh.locate(["k"]), timeout_s=10.0) == [[loc("a")]]
            known.close()
            fresh.close()
        finally:
            for s in sentinels:
                if stopped:
                    os.kill(s.proc.pid, signal.SIGCONT)
                s.stop()
