"""A real failover: primary + replica + Sentinel on loopback; SIGKILL the primary; the same
RedisDirectory object reaches the new primary by itself, keeps what was replicated, and whatever
was lost comes back through a resync."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import redis

from store_backend.pool.directory import DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_redis import RedisDirectory
from tests.store_backend.pool.redis_server import RedisProcess

T = TypeVar("T")
MASTER = "mymaster"


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
            time.sleep(0.1)


def wait_link_up(replica_port: int, password: str | None, timeout_s: float = 20.0) -> None:
    r = redis.Redis(port=replica_port, password=password, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    try:
        while r.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.1)
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
    assert until(lambda: d.heartbeat(info, 60.0)) in (True, False)
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
        time.sleep(0.1)
    assert "after" in seen
    # What could not be written comes back by the caller's resync (everything it holds).
    assert d.leading(["during"]) == 0
    assert d.register("a", [(k, loc("a")) for k in ["during", *(f"k{i}" for i in range(100))]], resync=True) == []
    assert d.leading(["during", *(f"k{i}" for i in range(100))]) == 101
    d.close()
    assert failover_s < 40.0


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
