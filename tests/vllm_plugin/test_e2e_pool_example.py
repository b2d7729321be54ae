"""``examples/pool/run_two_nodes.sh`` as a user runs it: Redis, two node services forming one pool
and one vLLM server attached to each (on vLLM's CPU build with the tiny model). A prompt computed by
the first server is loaded by the second from the first node over the pool, with the tokens of a
no-connector engine; a node service killed underneath stops the whole script (its cleanup stops
the servers and removes the killed service's arena from /dev/shm).
"""

from __future__ import annotations

import glob
import os
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
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, SERVER_FLAGS, complete, metric, script_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "pool" / "run_two_nodes.sh"
PROMPT = prompt(531, 500)
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
    directory = make_directory(DirectoryConfig(kind="redis", url=f"redis://127.0.0.1:{redis_port}/0"),
                               node_id="example-observer")
    try:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            keys = set(directory.node_keys(node_id))
            if len(keys) >= at_least or time.monotonic() > deadline:
                return keys
            time.sleep(0.1)
    finally:
        directory.close()


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


def test_the_second_node_loads_the_first_nodes_prefix_over_the_pool(cluster: dict[str, Any], tiny_model: Path) -> None:
    ports = cluster["ports"]
    full = (len(PROMPT) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    first = complete(ports["port1"], PROMPT)  # computed on node1, saved there and registered
    assert len(_node_keys(ports["redis"], "node1", full // CHUNK_TOKENS)) >= full // CHUNK_TOKENS
    before = metric(ports["port2"], "vllm:external_prefix_cache_hits_total")
    second = complete(ports["port2"], PROMPT)  # node2 holds nothing of it: loaded from node1
    assert metric(ports["port2"], "vllm:external_prefix_cache_hits_total") - before == full
    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [PROMPT], "max_tokens": MAX_TOKENS}]}, cluster["work"], "baseline")
    want = baseline["rounds"][0][0]["tokens"]
    assert first["choices"][0]["token_ids"] == want
    assert second["choices"][0]["token_ids"] == want


def test_a_node_service_killed_underneath_stops_the_script(cluster: dict[str, Any]) -> None:
    """Runs last in this module: it ends the cluster."""
    log: Path = cluster["log"]
    services = [pid for pid, cmd in _processes() if "store_backend.node serve" in cmd and cmd.endswith("/node2.json")]
    assert len(services) == 1, services
    os.kill(int(services[0]), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while "stopping the others" not in log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.5)
    text = log.read_text(errors="replace")
    assert f"process {services[0]} exited with status 137; stopping the others" in text, text[-3000:]
    # The cleanup stops the vLLM servers too: nothing answers on their ports any more.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            metric(cluster["ports"]["port1"], "vllm:num_requests_running")
        except OSError:
            break
        time.sleep(1)
    else:
        raise AssertionError("the vLLM server on PORT1 still answers after the script's cleanup")
    # ... and the killed service's arena segment does not stay behind in /dev/shm.
    deadline = time.monotonic() + 120
    while _arenas(cluster["started"]) and time.monotonic() < deadline:
        time.sleep(1)
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
