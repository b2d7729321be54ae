"""``examples/pool/run_two_nodes.sh`` as a user runs it: Redis, two node services forming one pool
(a shared secret, the TCP transport between the services on loopback) and one vLLM server attached
to each (on vLLM's CPU build with the tiny model). The two instances reuse each other's prefixes: a
prompt the first computed on node 1 is loaded by the second from node 1 over the pool, and the
other way round, with the tokens of a no-connector engine. Neither service has an SSD tier and
each engine sees only its own node's socket, so a hit on the other engine's prompt can only have
come through the pool; the reading node counts pool hits and keeps the objects as its own copies.
Then a node service killed underneath stops the whole script (its cleanup stops the servers and
removes the killed service's arena from /dev/shm).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store_backend.pool.config import DirectoryConfig
from store_backend.pool.factory import make_directory
from tests.store_backend.pool.redis_server import require_redis
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, run_engine
from tests.store_backend.node.server_harness import wait_until
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, SERVER_FLAGS, complete, metric, script_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "pool" / "run_two_nodes.sh"
P1, P2 = prompt(531, 600), prompt(532, 400)
REGISTER_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_redis()
    work = tmp_path_factory.mktemp("pool-example")
    started = time.time() - 1
    env = {**engine_env(), "MODEL": str(tiny_model), "CHUNK_TOKENS": str(CHUNK_TOKENS), "DRAM": "64MiB",
           "EXTRA_ARGS": SERVER_FLAGS, "MOONCAKE_KV_VENV": sys.prefix}
    with script_cluster(SCRIPT, work, env, stop_wait_s=120, ports=("PORT1", "PORT2", "REDIS_PORT"),
                        healthy=("PORT1", "PORT2")) as ports:
        yield {"ports": ports, "work": work, "log": work / "run_two_nodes.log", "started": started}


def _node_keys(redis_port: int, node_id: str, at_least: int) -> set[str]:
    """The keys ``node_id`` registered, once there are ``at_least`` (its registrar is asynchronous)."""
    directory = make_directory(DirectoryConfig(kind="redis", url=f"redis://127.0.0.1:{redis_port}/0"),
                               node_id="example-observer")
    try:
        def registered() -> tuple[set[str]] | None:  # a tuple: truthy even when no key is wanted
            keys = set(directory.node_keys(node_id))
            return (keys,) if len(keys) >= at_least else None

        return wait_until(registered, REGISTER_TIMEOUT_S, f"{node_id} registering at least {at_least} keys")[0]
    finally:
        directory.close()


def _pool_hits(node: str) -> int:
    """Hits the pool tier of the script's service ``node`` served (``store_backend.node status``
    on the socket its config names)."""
    configs = [cmd.rsplit(" ", 1)[-1] for _, cmd in _processes()
               if "store_backend.node serve" in cmd and cmd.endswith(f"/{node}.json")]
    assert len(configs) == 1, configs
    sock = json.loads(Path(configs[0]).read_text())["socket"]
    got = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, env=engine_env(), cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    return int(json.loads(got.stdout)["tiers"]["pool"]["hits"])


def _processes() -> list[tuple[str, str]]:
    """(pid, command line) of every process this user can see."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append((pid, cmd))
    return out


def test_each_node_loads_the_other_nodes_prefix_over_the_pool(cluster: dict[str, Any], tiny_model: Path) -> None:
    one, two, redis_port = cluster["ports"]["port1"], cluster["ports"]["port2"], cluster["ports"]["redis"]
    full = {id(p): (len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in (P1, P2)}
    hits = "vllm:external_prefix_cache_hits_total"
    out = {}

    out["one-p1"] = complete(one, P1)  # computed by instance one, saved to node 1 (and registered)
    p1_keys = _node_keys(redis_port, "node1", full[id(P1)] // CHUNK_TOKENS)
    assert not _node_keys(redis_port, "node2", 0) & p1_keys  # node 2 holds none of them yet
    hits_before, pool_before = metric(two, hits), _pool_hits("node2")
    out["two-p1"] = complete(two, P1)  # loaded by instance two from node 1, through node 2's pool tier
    assert metric(two, hits) - hits_before == full[id(P1)]
    assert _pool_hits("node2") - pool_before >= len(p1_keys)
    # Node 2 kept the objects it pulled as its own copies (and registered them).
    assert p1_keys <= _node_keys(redis_port, "node2", len(p1_keys))

    out["two-p2"] = complete(two, P2)  # computed by instance two on node 2
    p2_count = full[id(P2)] // CHUNK_TOKENS
    _node_keys(redis_port, "node2", len(p1_keys) + p2_count)
    hits_before, pool_before = metric(one, hits), _pool_hits("node1")
    out["one-p2"] = complete(one, P2)  # loaded by instance one from node 2
    assert metric(one, hits) - hits_before == full[id(P2)]
    assert _pool_hits("node1") - pool_before >= p2_count

    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in (P1, P2)]},
                          cluster["work"], "baseline")
    want1, want2 = (r[0]["tokens"] for r in baseline["rounds"])
    got = {k: v["choices"][0]["token_ids"] for k, v in out.items()}
    assert got == {"one-p1": want1, "two-p1": want1, "two-p2": want2, "one-p2": want2}


def test_a_node_service_killed_underneath_stops_the_script(cluster: dict[str, Any]) -> None:
    """Runs last in this module: it ends the cluster."""
    log: Path = cluster["log"]
    services = [pid for pid, cmd in _processes() if "store_backend.node serve" in cmd and cmd.endswith("/node2.json")]
    assert len(services) == 1, services
    os.kill(int(services[0]), signal.SIGKILL)
    wait_until(lambda: "stopping the others" in log.read_text(errors="replace"), 120,
               "the script saying it stops the others")
    text = log.read_text(errors="replace")
    assert f"process {services[0]} exited with status 137; stopping the others" in text, text[-3000:]
    # The cleanup stops the vLLM servers too: nothing answers on their ports any more.
    def port1_closed() -> bool:
        try:
            metric(cluster["ports"]["port1"], "vllm:num_requests_running")
        except OSError:
            return True
        return False

    wait_until(port1_closed, 120, "the vLLM server on PORT1 to stop answering after the script's cleanup")
    # ... and the killed service's arena segment does not stay behind in /dev/shm.
    wait_until(lambda: not _arenas(cluster["started"]), 120, "the killed service's arena segment to be removed")
    assert _arenas(cluster["started"]) == []


def _arenas(since: float) -> list[str]:
    """The example's arena segments in /dev/shm made since ``since`` (a wall-clock time)."""
    out = []
    for path in glob.glob("/dev/shm/mkv-example-node*"):
        try:
            if os.stat(path).st_mtime >= since:
                out.append(path)
        except FileNotFoundError:
            pass
    return out
