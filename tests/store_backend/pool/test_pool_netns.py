"""Three node services on three distinct hosts: each in its own network namespace, joined to the
others and to Redis only by a veth pair on a bridge (tests/store_backend/pool/netns.py). The pool
traffic crosses real interfaces with their own addresses, and a partition is a link taken down,
not a process stopped: the node keeps running and keeps serving its own engines (their Unix socket
is a file, reachable from the test) while nobody reaches it and it reaches nobody.

- Objects written on one host are read on the others, byte-identical, from DRAM and SSD.
- A partitioned holder: a remove made meanwhile answers IO_ERROR for its keys (it holds copies
  nobody can delete yet), the hosts that can be reached delete theirs, and no node hands out the
  removed bytes once the partition heals; a put of a removed key made on the partitioned host
  after the remove survives the remove's retry and is served pool-wide.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from store_backend.types import Status
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.netns import Hosts, require_netns
from tests.store_backend.pool.pool_nodes import (
    MiB,
    Pool,
    make_payload,
    put_all,
    put_past_dram,
    read,
    read_ok,
    started_pool,
    wait_located,
    wait_nodes_alive,
)
from tests.store_backend.pool.redis_server import RedisProcess

SIZE = 1 * MiB
NAMES = ("A", "B", "C")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    require_netns()
    with Hosts(len(NAMES)) as h:
        yield h


@contextlib.contextmanager
def _pool_on(hosts: Hosts) -> Iterator[Pool]:
    # Redis listens on the bridge (the hosts' way to it) and on loopback (the test's own checks).
    with RedisProcess(extra=[f"bind 127.0.0.1 {hosts.gateway}"]) as server:
        with started_pool(f"redis://{hosts.gateway}:{server.port}/0", NAMES,
                          per_node=[{"prefix": hosts.exec_prefix(i), "listen": f"{hosts.ips[i]}:0"}
                                    for i in range(len(NAMES))]) as pool:
            yield pool


@pytest.fixture
def net_pool(hosts: Hosts) -> Iterator[Pool]:
    with _pool_on(hosts) as pool:
        yield pool


def test_objects_written_on_one_host_are_read_on_the_others_over_veth(hosts: Hosts, net_pool: Pool) -> None:
    (a, b, c), d = net_pool
    # Each node advertises its own host's address: the reads below cross the veth links.
    addresses = {n.node_id: n.address for n in d.nodes()}
    for i, name in enumerate(NAMES):
        assert addresses[name].startswith(f"{hosts.ips[i]}:"), addresses
    ca = a.client()
    keys = [f"host-{i:02d}" for i in range(24)]  # 24 MiB into 16 MiB of DRAM: the first ones on SSD only
    on_ssd, in_dram = put_past_dram(ca, d, "A", keys, SIZE)
    read_ok(b.client(), keys, SIZE, 1)
    read_ok(c.client(), [*on_ssd[:4], *in_dram[:4]], SIZE, 1)
    assert b.client().stats().pool.bytes_read >= len(keys) * SIZE


def test_a_partitioned_holder_never_serves_removed_bytes_after_it_heals(hosts: Hosts, net_pool: Pool) -> None:
    (a, b, c), d = net_pool
    ca, cb, cc = a.client(), b.client(), c.client()
    removed = [f"part-{i}" for i in range(6)]
    again = "part-again"
    put_all(ca, {k: make_payload(k, 1, SIZE) for k in [*removed, again]})
    wait_located(d, [*removed, again], "A")
    read_ok(cb, [*removed, again], SIZE, 1)  # B pulls them: local copies there, registered
    wait_located(d, [*removed, again], "B")

    hosts.cut(1)  # B: no Redis, no peers
    wait_until(lambda: not {n.node_id: n.alive for n in d.nodes()}["B"], 20, "B counted dead")
    read_ok(cb, removed, SIZE, 1)  # B's engines are still served from B's own tiers

    # C removes them: A deletes its copies, B cannot be asked: IO_ERROR for every key (B holds them).
    t_remove = time.time()
    assert cc.remove([*removed, again]) == [Status.IO_ERROR] * (len(removed) + 1)
    assert ca.tier_of([*removed, again]) == [None] * (len(removed) + 1)
    got, _ = read(cc, removed, SIZE)
    assert [r.status for r in got] == [Status.NOT_FOUND] * len(removed)  # nobody reachable holds them

    # On B, cut off, an engine removes ``again`` (B's own copy goes; the pool part fails) and
    # puts a new version of it, after C's remove.
    assert cb.remove([again]) == [Status.IO_ERROR]
    owed = len(removed) + 1
    assert cc.stats().queues.pool_remove == owed  # C owes B the remove of every key
    assert cb.tier_of([again]) == [None]
    # Clearly newer than the remove: past twice clock_skew_s (1 s), what a retry asks of a copy it keeps.
    time.sleep(max(0.0, t_remove + 2.5 - time.time()))  # past twice clock_skew_s, as above
    put_all(cb, {again: make_payload(again, 2, SIZE)})

    hosts.heal(1)
    wait_nodes_alive(d, ["B"])
    # B's removed copies go (the remove's retry, or B's resync against the tombstones), and the
    # new version of ``again`` stays: committed after the remove, it is kept by the retry and
    # accepted by the directory.
    wait_until(lambda: cb.tier_of(removed) == [None] * len(removed), 60, "B's removed copies deleted")
    # C's retry reaches B and B confirms every key: deleted, or (``again``) kept as newer and
    # answered NOT_FOUND. With the retry deleting whatever B holds (before the fix), the new
    # version was gone here and the wait for its location below failed.
    wait_until(lambda: cc.stats().queues.pool_remove == 0, 90, "C's remove confirmed by B")
    for client in (ca, cb, cc):
        got, _ = read(client, removed, SIZE)
        assert [r.status for r in got] == [Status.NOT_FOUND] * len(removed)
    wait_located(d, [again], "B")
    read_ok(cc, [again], SIZE, 2)
    read_ok(cb, [again], SIZE, 2)
