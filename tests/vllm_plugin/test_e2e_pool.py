"""Two vLLM instances on two node services that form one pool (a real Redis directory, the TCP
transport between the services on loopback) reuse each other's prefixes: a prompt the first
computed on node 1 is loaded by the second from node 1 over the pool, and the other way round,
with the tokens of a no-connector engine. Neither service has an SSD tier and each engine sees
only its own node's socket, so a hit on the other engine's prompt can only have come through the
pool; the reading node counts pool hits and keeps the objects as its own copies afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store_backend.pool.config import DirectoryConfig
from tests.node_service import ServiceRun
from tests.store_backend.pool.redis_server import RedisProcess, require_redis
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import (
    MAX_TOKENS,
    complete,
    free_port,
    metric,
    node_service_server,
    stop,
    wait_healthy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P1, P2 = prompt(431, 600), prompt(432, 400)
NODES = ("pool-e2e-1", "pool-e2e-2")
REGISTER_TIMEOUT_S = 30.0


def pool_service(work: Path, name: str, node_id: str, redis_url: str, secret_file: str) -> ServiceRun:
    """A node service (DRAM only) whose pool section names the shared Redis, as docs/POOL.md shows."""
    run = ServiceRun(work, {"dram": {"capacity_bytes": "64MiB"}}, name=name)
    run.config["pool"] = {"node_id": node_id, "listen": "127.0.0.1:0", "secret_file": secret_file,
                          "heartbeat_s": 0.5, "node_ttl_s": 5.0,
                          "directory": {"kind": "redis", "url": redis_url, "namespace": "mkv-e2e"}}
    run.config_path.write_text(json.dumps(run.config))
    return run


def _directory(url: str):  # noqa: ANN202
    from store_backend.pool.factory import make_directory

    return make_directory(DirectoryConfig(kind="redis", url=url, namespace="mkv-e2e"), node_id="e2e-observer")


def _wait_keys(directory: Any, node_id: str, at_least: int) -> set[str]:
    """The keys ``node_id`` registered, once there are ``at_least`` (its registrar is asynchronous)."""
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while True:
        keys = set(directory.node_keys(node_id))
        if len(keys) >= at_least:
            return keys
        if time.monotonic() > deadline:
            raise AssertionError(f"{node_id} registered {len(keys)} keys, expected at least {at_least}")
        time.sleep(0.1)


def _pool_hits(status: dict[str, Any]) -> int:
    """Hits the pool tier of a node served (its status, ``mooncake-kv status --json``)."""
    return int(status["tiers"]["pool"]["hits"])


@pytest.fixture(scope="module")
def pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_redis()
    work = tmp_path_factory.mktemp("pool-e2e")
    secret_dir = tempfile.mkdtemp(prefix="mkv-secret-")
    secret_file = os.path.join(secret_dir, "pool.secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("pool-e2e-secret")
    with RedisProcess() as redis:
        services = [pool_service(work, f"node{i + 1}", NODES[i], redis.url, secret_file) for i in range(2)]
        procs: list[subprocess.Popen] = []
        directory = None
        try:
            for svc in services:
                svc.start()
            directory = _directory(redis.url)
            ports = [free_port(), free_port()]
            logs = [work / "one.log", work / "two.log"]
            procs = [node_service_server(tiny_model, port, svc, log) for port, svc, log in zip(ports, services, logs)]
            for port in ports:
                wait_healthy(f"http://127.0.0.1:{port}", procs, logs)
            yield {"ports": ports, "work": work, "services": services, "directory": directory}
        finally:
            stop(procs)
            if directory is not None:
                directory.close()
            for svc in services:
                svc.close()
            os.unlink(secret_file)
            os.rmdir(secret_dir)


def _hits(port: int) -> float:
    return metric(port, "vllm:external_prefix_cache_hits_total")


def test_an_engine_on_another_node_loads_the_prefix_over_the_pool(pool: dict[str, Any], tiny_model: Path) -> None:
    one, two = pool["ports"]
    node1, node2 = pool["services"]
    directory = pool["directory"]
    full = {id(p): (len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in (P1, P2)}
    out = {}

    out["one-p1"] = complete(one, P1)  # computed by instance one, saved to node 1 (and registered)
    p1_keys = _wait_keys(directory, NODES[0], full[id(P1)] // CHUNK_TOKENS)
    assert not set(directory.node_keys(NODES[1])) & p1_keys  # node 2 holds none of them yet
    hits_before, pool_before = _hits(two), _pool_hits(node2.status())
    out["two-p1"] = complete(two, P1)  # loaded by instance two from node 1, through node 2's pool tier
    assert _hits(two) - hits_before == full[id(P1)]
    status2 = node2.status()
    assert _pool_hits(status2) - pool_before >= len(p1_keys), (status2["tiers"], status2["clients"])
    # Node 2 kept the objects it pulled as its own copies (and registered them).
    assert p1_keys <= _wait_keys(directory, NODES[1], len(p1_keys))

    out["two-p2"] = complete(two, P2)  # computed by instance two on node 2
    p2_count = full[id(P2)] // CHUNK_TOKENS
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while len(set(directory.node_keys(NODES[1])) - p1_keys) < p2_count and time.monotonic() < deadline:
        time.sleep(0.1)
    hits_before, pool_before = _hits(one), _pool_hits(node1.status())
    out["one-p2"] = complete(one, P2)  # loaded by instance one from node 2
    assert _hits(one) - hits_before == full[id(P2)]
    status1 = node1.status()
    assert _pool_hits(status1) - pool_before >= p2_count, (status1["tiers"], status1["clients"])

    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in (P1, P2)]},
                          pool["work"], "baseline")
    want1, want2 = (r[0]["tokens"] for r in baseline["rounds"])
    got = {k: v["choices"][0]["token_ids"] for k, v in out.items()}
    assert got == {"one-p1": want1, "two-p1": want1, "two-p2": want2, "one-p2": want2}
