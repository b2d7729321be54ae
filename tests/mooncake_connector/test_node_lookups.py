"""The scheduler's lookups in node mode (:class:`mooncake_connector.lookup_client.NodeLookups`)
against a real node service subprocess: every shard in one round trip, saves in flight counted,
pins with the slowest tier per chunk, a wait that answers at the commit (not at its deadline), and
a lost service answered as misses and counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_connector.config import NodeAttachConfig
from mooncake_connector.lookup_client import NodeLookups
from mooncake_connector.stores import acquire_node, release_store
from store_backend.node.client import NodeClient
from tests.node_service import ServiceRun, node_service

pytestmark = pytest.mark.timeout(180)

SIZE = 4096
SHARDS = [[f"s0/{i}" for i in range(4)], [f"s1/{i}" for i in range(4)]]


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ServiceRun]:
    with node_service(tmp_path, {"dram": {"capacity_bytes": "8MiB"}}) as run:
        yield run


@pytest.fixture
def client(svc: ServiceRun) -> Iterator[NodeClient]:
    c = acquire_node(NodeAttachConfig(socket=svc.socket, connect_timeout_s=2, op_timeout_s=5), name="test")
    yield c
    release_store(c, flush=False)


def _put(c: NodeClient, keys: list[str]) -> None:
    assert all(st.ok for st in c.put(keys, [bytes(SIZE)] * len(keys)))


def test_exists_all_is_the_shortest_run_over_shards_with_saves_in_flight_counted(client: NodeClient) -> None:
    lookups = NodeLookups(client, failures=lambda: client.counters.failures)
    _put(client, SHARDS[0])
    _put(client, SHARDS[1][:2])
    assert lookups.exists_all(SHARDS) == 2
    held = client.reserve([SHARDS[1][2]], [SIZE])  # another process's save in flight
    assert lookups.exists_all(SHARDS) == 3
    client.abort(held)
    assert lookups.exists_all(SHARDS) == 2
    assert lookups.failures == 0


def test_pin_tiers_answers_per_chunk_and_none_where_a_shard_lacks_it(client: NodeClient) -> None:
    lookups = NodeLookups(client)
    _put(client, SHARDS[0])
    _put(client, SHARDS[1][:3])
    assert lookups.pin_tiers(SHARDS, ttl_s=5) == ["dram", "dram", "dram", None]
    client.unpin(SHARDS[0] + SHARDS[1][:3])


def test_wait_stored_answers_when_the_commit_lands(client: NodeClient, svc: ServiceRun) -> None:
    lookups = NodeLookups(client)
    writer = acquire_node(NodeAttachConfig(socket=svc.socket), name="writer")  # the same client (one per process)
    assert writer is client
    other = NodeClient(svc.socket, name="prefill").start()  # another engine's connection
    try:
        held = other.reserve([k for keys in SHARDS for k in keys], [SIZE] * 8)
        for r in held:
            r.view[:] = bytes(SIZE)
        done = threading.Timer(1.0, lambda: other.commit(held))
        done.start()
        t0 = time.monotonic()
        assert lookups.wait_stored(SHARDS, timeout_s=30) == 4
        waited = time.monotonic() - t0
        done.join()
        assert 0.5 < waited < 10, waited  # at the commit, not at the 30 s deadline
        # Nothing to wait for: at once.
        t0 = time.monotonic()
        assert lookups.wait_stored(SHARDS, timeout_s=30) == 4
        assert time.monotonic() - t0 < 2
    finally:
        other.close(flush=False)
    release_store(writer, flush=False)


def test_a_lost_service_is_a_miss_counted_as_a_failure(client: NodeClient, svc: ServiceRun) -> None:
    lookups = NodeLookups(client, failures=lambda: client.counters.failures)
    _put(client, SHARDS[0] + SHARDS[1])
    assert lookups.exists_all(SHARDS) == 4
    svc.kill()
    assert lookups.exists_all(SHARDS) == 0
    assert lookups.pin_tiers(SHARDS, ttl_s=5) == [None] * 4
    assert lookups.failures >= 2
