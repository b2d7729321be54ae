"""Prefill on one node, decode on another: ``examples/vllm_disagg/run_1p1d_pool.sh`` as a user runs
it (Redis, two pooled node services, a prefill server on the first, a decode server on the second,
the proxy), on vLLM's CPU build with the tiny model.

The decode server must answer with exactly the tokens of a no-connector engine and load exactly the
chunks the prefill server stored. Asked the moment the prefill server answered (its saves may still
be in flight), its scheduler waits on the prefill node for their commit (the transfer parameters
name that node and its address; the prefill node's transport counts the waits it answered), and
the bytes cross the pool: the decode node's pool tier counts the hits (both services are on one
machine, so only its counters can tell a pool read from a shared segment, and the decode server is
attached to its own node's socket only).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store_backend.pool.config import DirectoryConfig
from store_backend.pool.factory import make_directory
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.redis_server import require_redis
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, SERVER_FLAGS, complete, metric, script_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "vllm_disagg" / "run_1p1d_pool.sh"
PROMPTS = [prompt(631, 700), prompt(632, 300)]
DIRECT = prompt(633, 520)  # sent by the test itself: prefill, then decode at once


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_redis()
    work = tmp_path_factory.mktemp("pool-disagg")
    env = {**engine_env(), "MODEL": str(tiny_model), "CHUNK_TOKENS": str(CHUNK_TOKENS), "DRAM": "64MiB",
           "EXTRA_ARGS": SERVER_FLAGS, "MOONCAKE_KV_VENV": sys.prefix}
    with script_cluster(SCRIPT, work, env, stop_wait_s=120,
                        ports=("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT", "REDIS_PORT")) as ports:
        log = work / f"{SCRIPT.stem}.log"
        line = wait_until(lambda: re.search(r"node services: (\S+) (\S+) ", log.read_text(errors="replace")), 60,
                          "the script naming its node services")
        yield {"ports": ports, "work": work, "sockets": {"prefill": line.group(1), "decode": line.group(2)}}


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _pool_hits(sock: str) -> int:
    got = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, env=engine_env(), cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    return int(json.loads(got.stdout)["tiers"]["pool"]["hits"])


def _server_waits(redis_port: int, node: str) -> int:
    """The waits ``node``'s transport answered, as its heartbeat last published them."""
    directory = make_directory(DirectoryConfig(kind="redis", url=f"redis://127.0.0.1:{redis_port}/0"),
                               node_id="test-observer")
    try:
        return next(n.counters.get("server_waits", 0) for n in directory.nodes() if n.node_id == node)
    finally:
        directory.close()


def test_decode_on_another_node_waits_on_the_prefill_node_and_loads_over_the_pool(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    ports, sockets = cluster["ports"], cluster["sockets"]
    hits = "vllm:external_prefix_cache_hits_total"
    pool_before = _pool_hits(sockets["decode"])
    outputs = [complete(ports["proxy"], p) for p in PROMPTS]

    # The decode leg by hand: prefill answers with what it stored and where, decode is asked at once.
    body = {"model": "tiny", "prompt": DIRECT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    hits_before = metric(ports["decode"], hits)
    prefilled = _post(ports["prefill"], {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = prefilled["kv_transfer_params"]
    assert params["remote_node"] == "prefill-node" and params["remote_pool_address"].startswith("127.0.0.1:")
    assert params["transfer_id"]
    t0 = time.monotonic()
    direct = _post(ports["decode"], {**body, "kv_transfer_params": params})
    decode_s = time.monotonic() - t0
    direct_hits = metric(ports["decode"], hits) - hits_before

    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in [*PROMPTS, DIRECT]]},
                          cluster["work"], "baseline")
    want = [r[0]["tokens"] for r in baseline["rounds"]]
    assert [o["choices"][0]["token_ids"] for o in outputs] + [direct["choices"][0]["token_ids"]] == want

    stored = params["remote_prefix_tokens"]
    assert stored == len(DIRECT) // CHUNK_TOKENS * CHUNK_TOKENS
    assert direct_hits == min(stored, (len(DIRECT) - 1) // CHUNK_TOKENS * CHUNK_TOKENS)
    assert decode_s < 20, decode_s  # answered at the commit, nowhere near remote_prefill_wait_s (30 s)
    chunks = [(len(p) - 1) // CHUNK_TOKENS for p in [*PROMPTS, DIRECT]]
    assert metric(ports["decode"], hits) == sum(chunks) * CHUNK_TOKENS
    assert metric(ports["decode"], "vllm:prefix_cache_hits_total") == 0
    # Every chunk the decode server loaded crossed the pool from the prefill node.
    assert _pool_hits(sockets["decode"]) - pool_before >= sum(chunks)
    # The decode side waited on the prefill node once per request (its heartbeat publishes the count).
    wait_until(lambda: _server_waits(ports["redis"], "prefill-node") >= len(chunks), 30,
               "the prefill node's heartbeat counting the waits it answered")
