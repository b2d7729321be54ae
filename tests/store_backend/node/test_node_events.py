"""A node service with an ``events`` section publishes what its store holds: a client's puts and
removes reach an index subscribed to it, and a token query through the index matches the store's
own ``exists`` on random prompts (once the index has the last batch). The HTTP API answers the same
over a real socket, and refuses a malformed query naming what was wrong."""

from __future__ import annotations

import os
import random

import httpx
import numpy as np
import pytest

from mooncake_connector.keys import chunk_hashes, object_key
from mooncake_kv.index.http import serve_in_thread
from mooncake_kv.index.service import IndexConfig, KVIndex
from store_backend.events.subscriber import SourceConfig
from store_backend.config import ConfigError
from store_backend.node.server import NodeService
from store_backend.types import Status
from tests.store_backend.conftest import serve_node
from tests.store_backend.node.server_harness import wait_until

CHUNK = 16
OBJ = 4096
DIGEST = "fp0123"
LOCAL = "tcp://127.0.0.1:*"


@pytest.fixture
def node():  # noqa: ANN201
    client = serve_node({"dram": {"capacity_bytes": 8 << 20}},
                        events={"endpoint": LOCAL, "replay_endpoint": LOCAL, "backend_id": "node-x"})
    try:
        yield client
    finally:
        client.close(flush=False, timeout_s=10)


def _index(service: NodeService) -> KVIndex:
    pub = service.events
    assert pub is not None
    src = SourceConfig(name="node-x", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, snapshot=True)
    index = KVIndex(IndexConfig(sources=[src], chunk_tokens=CHUNK)).start()
    assert index.wait_synced(10)
    return index


def _absorbed(service: NodeService, index: KVIndex) -> None:
    assert service.store is not None and service.store.wait_idle(10)
    pub = service.events
    assert pub is not None and pub.wait_published(10)
    sub = index.subscriber("node-x")
    wait_until(lambda: sub.stats()["next_seq"] == pub.stats()["next_seq"], 10, "the index at the last batch")


def test_token_queries_through_the_index_match_the_stores_exists(node) -> None:  # noqa: ANN001
    rng = random.Random(5)
    index = _index(node.service)
    try:
        prompts = [[rng.randrange(1000) for _ in range(CHUNK * rng.randrange(1, 7))] for _ in range(12)]
        for p in prompts:  # store a random leading part of each prompt's chunks, some removed again
            keys = [object_key(DIGEST, h) for h in chunk_hashes(p, CHUNK)]
            stored = keys[:rng.randrange(len(keys) + 1)]
            assert node.put(stored, [np.full(OBJ, 7, np.uint8)] * len(stored)) == [Status.OK] * len(stored)
            if stored and rng.random() < 0.3:
                assert node.remove([stored[-1]]) == [Status.OK]
        _absorbed(node.service, index)
        for p in prompts + [[rng.randrange(1000) for _ in range(CHUNK * 3)]]:
            keys = [object_key(DIGEST, h) for h in chunk_hashes(p, CHUNK)]
            got = index.query_tokens(p, fingerprints=[DIGEST])
            want = node.exists_all([keys]) if keys else 0
            assert got.longest_matched == want
            if want:
                assert got.instances["node-x"].by_medium == {"CPU": want}
                assert got.instances["node-x"].matched_tokens == want * CHUNK
            assert index.query_tokens(p).longest_matched == want  # every digest seen: this one
    finally:
        index.close()


def test_the_http_api_answers_queries_and_refuses_malformed_ones(node) -> None:  # noqa: ANN001
    index = _index(node.service)
    port, stop = serve_in_thread(index)
    try:
        p = list(range(CHUNK * 2))
        keys = [object_key(DIGEST, h) for h in chunk_hashes(p, CHUNK)]
        assert node.put(keys, [np.zeros(OBJ, np.uint8)] * 2) == [Status.OK] * 2
        _absorbed(node.service, index)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            r = http.post("/query", json={"token_ids": p})
            assert r.status_code == 200
            body = r.json()
            assert body["longest_matched"] == 2 and body["instances"]["node-x"]["by_medium"] == {"CPU": 2}
            assert http.post("/query", json={"keys": keys[1:]}).json()["longest_matched"] == 1
            assert http.get("/health").json() == {"ok": True, "synced": True}
            assert http.get("/sources").json()["node-x"]["blocks"] == {"CPU": 2}
            bad = http.post("/query", json={"token_ids": p, "keys": keys})
            assert bad.status_code == 400 and "exactly one of" in bad.json()["error"]
            bad = http.post("/query", json={"token_ids": "abc"})
            assert bad.status_code == 400 and "token_ids" in bad.json()["error"]
            bad = http.post("/query", json={"token_ids": [1, 2**63]})
            assert bad.status_code == 400 and "64-bit" in bad.json()["error"]
    finally:
        stop()
        index.close()


def test_an_events_endpoint_that_cannot_be_bound_is_a_config_error(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="events.endpoint 'tcp://256.0.0.1:1': cannot bind"):
        NodeService({"store": {"dram": {"capacity_bytes": 1 << 20, "shm_name": "mkv-ev-bad"}},
                     "socket": str(tmp_path / "n.sock"), "metrics": None,
                     "events": {"endpoint": "tcp://256.0.0.1:1"}}).open()


def test_status_names_the_event_endpoints(node, capsys) -> None:  # noqa: ANN001
    from store_backend.node.__main__ import print_status, probe, status_document

    doc = status_document(probe(node.service.socket_path))
    pub = node.service.events
    assert doc["events"] == {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "backend_id": "node-x"}
    print_status(doc)
    assert pub.endpoint in capsys.readouterr().out


def test_the_index_names_the_node_its_attached_engines_and_fingerprints(node) -> None:  # noqa: ANN001
    """A node service answers "about" on its replay socket (its backend id, the processes attached
    now); the index keeps it per source beside the fingerprint digests its events named."""
    index = _index(node.service)
    try:
        keys = [object_key(DIGEST, h) for h in chunk_hashes(list(range(CHUNK)), CHUNK)]
        assert node.put(keys, [np.zeros(OBJ, np.uint8)]) == [Status.OK]
        _absorbed(node.service, index)
        wait_until(lambda: index.status()["node-x"]["about"], 10, "the about answer")
        about = index.status()["node-x"]["about"]
        assert about["backend_id"] == "node-x"
        assert os.getpid() in {c["pid"] for c in about["clients"]}  # this process's client is attached
        assert index.status()["node-x"]["fingerprints"] == [DIGEST]
    finally:
        index.close()
