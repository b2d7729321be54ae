"""Prefill on one node, decode on another: ``examples/vllm_disagg/run_1p1d_pool.sh`` as a user runs
it (Redis, two pooled node services, a prefill server on the first, a decode server on the second,
the proxy), on vLLM's CPU build with the tiny model.

The decode server must answer with exactly the tokens of a no-connector engine and load exactly the
chunks the prefill server stored. Asked the moment the prefill server answered (its saves may still
be in flight), its scheduler waits on the prefill node for their commit (the transfer parameters
name that node and its address; the prefill node's transport counts the waits it answered), and
the bytes cross the pool: the decode node's pool tier counts the hits (both services are on one
machine, so only its counters can tell a pool read from a shared segment, and the decode server is
attached to its own node's socket only). Both servers name their KV layout (TP 1) in their
/metrics before their first request, which the router checks before it pairs them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_connector.keys import chunk_hashes, object_key
from mooncake_kv.route.server import kv_layout_of
from store_backend.pool.config import DirectoryConfig
from store_backend.pool.factory import make_directory
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.redis_server import require_redis
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt
from tests.vllm_plugin.disagg_cluster import (MAX_TOKENS, SERVER_FLAGS, baseline_tokens, complete, direct_leg,
                                              free_port, metric, post, script_cluster)

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


def _pool_tier(sock: str) -> dict[str, Any]:
    """The pool tier's counters of the service at ``sock`` (``store_backend.node status --json``)."""
    got = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, env=engine_env(), cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    return json.loads(got.stdout)["tiers"]["pool"]


def _pool_hits(sock: str) -> int:
    return int(_pool_tier(sock)["hits"])


def _published(redis_port: int, node: str) -> dict[str, int]:
    """The counters ``node`` published with its last heartbeat."""
    directory = make_directory(DirectoryConfig(kind="redis", url=f"redis://127.0.0.1:{redis_port}/0"),
                               node_id="test-observer")
    try:
        return next((dict(n.counters) for n in directory.nodes() if n.node_id == node), {})
    finally:
        directory.close()


def _layout(port: int) -> Any:
    """The KV layout the server at ``port`` names in its /metrics (None: none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return kv_layout_of(r.read().decode())


def _server_waits(redis_port: int, node: str) -> int:
    """The waits ``node``'s transport answered, as its heartbeat last published them."""
    return _published(redis_port, node).get("server_waits", 0)


def test_decode_on_another_node_waits_on_the_prefill_node_and_loads_over_the_pool(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    ports, sockets = cluster["ports"], cluster["sockets"]
    # Before any request (no engine step yet): each server's layout, from its scheduler's start.
    layouts = [_layout(ports["prefill"]), _layout(ports["decode"])]
    assert layouts[0] is not None and layouts[0] == layouts[1], layouts
    assert (layouts[0].tp_size, layouts[0].pp_size, layouts[0].chunk_tokens) == (1, 1, CHUNK_TOKENS)
    hits = "vllm:external_prefix_cache_hits_total"
    pool_before = _pool_hits(sockets["decode"])
    outputs = [complete(ports["proxy"], p) for p in PROMPTS]

    # The decode leg by hand: prefill answers with what it stored and where, decode is asked at once.
    leg = direct_leg(ports["prefill"], ports["decode"], DIRECT)
    assert leg.params["remote_node"] == "prefill-node" and leg.params["remote_pool_address"].startswith("127.0.0.1:")
    assert leg.params["transfer_id"]
    want = baseline_tokens(tiny_model, cluster["work"], [*PROMPTS, DIRECT])
    assert [o["choices"][0]["token_ids"] for o in outputs] + [leg.tokens] == want
    stored = leg.params["remote_prefix_tokens"]
    assert stored == len(DIRECT) // CHUNK_TOKENS * CHUNK_TOKENS
    assert leg.hits == min(stored, (len(DIRECT) - 1) // CHUNK_TOKENS * CHUNK_TOKENS)
    assert leg.decode_s < 20, leg.decode_s  # answered at the commit, nowhere near remote_prefill_wait_s (30 s)
    chunks = [(len(p) - 1) // CHUNK_TOKENS for p in [*PROMPTS, DIRECT]]
    assert metric(ports["decode"], hits) == sum(chunks) * CHUNK_TOKENS
    assert metric(ports["decode"], "vllm:prefix_cache_hits_total") == 0
    # Every chunk the decode server loaded crossed the pool from the prefill node.
    assert _pool_hits(sockets["decode"]) - pool_before >= sum(chunks)
    # The decode side waited on the prefill node once per request (its heartbeat publishes the count).
    wait_until(lambda: _server_waits(ports["redis"], "prefill-node") >= len(chunks), 30,
               "the prefill node's heartbeat counting the waits it answered")


def test_the_router_sends_a_long_prompt_in_two_legs_and_a_short_one_to_decode_alone(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    """``mooncake-kv route`` with a prefill pool and a decode pool in front of the same two
    servers: a long prompt is prefilled on the prefill server (one token, its transfer parameters
    back; the decode instance's pool node named, so each chunk is pushed there as it is stored) and
    decoded on the decode server, which loads every chunk; a prompt with no whole chunk to hand
    over goes to the decode server alone. Tokens equal a no-connector engine."""
    ports, work = cluster["ports"], cluster["work"]
    rp = free_port()
    config = {"port": rp, "policy": "conductor", "chunk_tokens": CHUNK_TOKENS, "health_interval_s": 0.5,
              "instances": [{"name": "p", "url": f"http://127.0.0.1:{ports['prefill']}", "role": "prefill"},
                            {"name": "d", "url": f"http://127.0.0.1:{ports['decode']}", "role": "decode",
                             "node": "decode-node"}]}
    (work / "router.json").write_text(json.dumps(config))
    log = work / "router.log"
    router = subprocess.Popen([sys.executable, "-m", "mooncake_kv.cli", "route", "--config", str(work / "router.json")],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env(), cwd=ROOT)
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{rp}/health", timeout=5) as r:
                    return r.status == 200
            except OSError:
                if router.poll() is not None:
                    raise AssertionError(f"the router exited: {log.read_text()[-3000:]}") from None
                return False

        wait_until(healthy, 60, "the router's /health")
        long_p, short_p = prompt(641, 600), prompt(642, CHUNK_TOKENS - 10)
        hits = metric(ports["decode"], "vllm:external_prefix_cache_hits_total")
        pushed = _published(ports["redis"], "prefill-node").get("pushes_sent", 0)
        got = [complete(rp, p)["choices"][0]["token_ids"] for p in (long_p, short_p)]
        with urllib.request.urlopen(f"http://127.0.0.1:{rp}/router/decisions", timeout=10) as r:
            decisions = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{rp}/router/status", timeout=10) as r:
            status = json.loads(r.read())
    finally:
        router.terminate()
        router.wait(30)
    assert got == baseline_tokens(tiny_model, work, [long_p, short_p])
    assert [(d["leg"], d["choice"], d["reason"], d["status"]) for d in decisions] == [
        ("prefill", "p", decisions[0]["reason"], "done"), ("decode", "d", "prefilled", "done"),
        ("decode", "d", "short", "done")]
    assert decisions[1]["pair"] == decisions[0]["id"]
    # The router read both layouts (TP 1) and pairs them.
    assert [status["instances"][n]["layout"]["tp_size"] for n in ("p", "d")] == [1, 1]
    assert status["layout_mismatches"] == []
    chunks = (len(long_p) - 1) // CHUNK_TOKENS
    assert metric(ports["decode"], "vllm:external_prefix_cache_hits_total") - hits == chunks * CHUNK_TOKENS
    # The prefill node pushed the chunks to the decode node (its heartbeat publishes the count).
    wait_until(lambda: _published(ports["redis"], "prefill-node").get("pushes_sent", 0) - pushed >= chunks, 30,
               "the prefill node's heartbeat counting its pushes")


def _pid_of(what: str, match: Callable[[list[str]], bool]) -> int:
    """The process whose command line (its arguments) ``match`` accepts."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if match(args):
            return int(pid)
    raise AssertionError(f"no {what}")


def _redis_pid(port: int) -> int:
    """The script's redis-server (its title: "redis-server 127.0.0.1:PORT")."""
    return _pid_of(f"redis-server on port {port}",
                   lambda args: args[0].startswith("redis-server") and f":{port}" in " ".join(args))


def test_with_the_directory_down_the_decode_node_reads_from_the_holder_its_wait_confirmed(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    """Redis stopped (SIGSTOP) for the whole transfer: the prefill node saves, the decode node's
    wait on it is answered at the commit (the transfer's address, no directory needed), and the
    decode node reads every chunk from that node though the directory cannot say where they are.
    Tokens equal a no-connector engine; the decode node counts the directory's failures."""
    ports, sockets = cluster["ports"], cluster["sockets"]
    p = prompt(651, 520)
    redis = _redis_pid(ports["redis"])
    before = _pool_tier(sockets["decode"])
    os.kill(redis, signal.SIGSTOP)
    try:
        leg = direct_leg(ports["prefill"], ports["decode"], p)
    finally:
        os.kill(redis, signal.SIGCONT)
    after = _pool_tier(sockets["decode"])
    chunks = (len(p) - 1) // CHUNK_TOKENS
    assert leg.tokens == baseline_tokens(tiny_model, cluster["work"], [p])[0]
    assert leg.hits == chunks * CHUNK_TOKENS and leg.decode_s < 20, leg
    assert after["hits"] - before["hits"] >= chunks
    assert after["failures"]["directory"] > before["failures"]["directory"]


def test_chunks_corrupted_on_the_way_are_never_loaded(cluster: dict[str, Any], tiny_model: Path) -> None:
    """The transfer's address rewritten to a relay that flips one byte of every connection's
    stream from the prefill node, past the handshake and the wait's answer: the decode node's
    read fails its checks (counted), the engine computes what it could not load, and its tokens
    equal a no-connector engine's."""
    from tests.store_backend.pool.transport_helpers import FlipProxy

    ports, sockets = cluster["ports"], cluster["sockets"]
    p = prompt(661, 520)
    body = {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    params = post(ports["prefill"], {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})[
        "kv_transfer_params"]
    relay = FlipProxy(params["remote_pool_address"], flip_at=16 << 10, direction="down")
    try:
        before = _pool_tier(sockets["decode"])
        out = post(ports["decode"], {**body, "kv_transfer_params": {**params, "remote_pool_address": relay.address}})
        after = _pool_tier(sockets["decode"])
    finally:
        relay.close()
    assert relay.flipped >= 1
    assert out["choices"][0]["token_ids"] == baseline_tokens(tiny_model, cluster["work"], [p])[0]
    # The frames' keyed checksums caught it: a payload's (checksum) or a header's tag (protocol).
    failed = sum(after["failures"][k] - before["failures"][k] for k in ("checksum", "protocol"))
    assert failed >= 1, (before, after)


def test_a_decode_that_never_comes_leaves_nothing_held(cluster: dict[str, Any]) -> None:
    """A prefill leg whose decode leg never comes (pushed to the decode node, too): once prefill
    has answered, neither node service holds a reservation or a lease for it (the prefill engine
    freed its blocks when its saves landed; a pushed copy is an ordinary object on the decode
    node), so nothing waits on a lease to be released."""
    ports, sockets = cluster["ports"], cluster["sockets"]
    body = {"model": "tiny", "prompt": prompt(671, 520), "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True, "remote_decode_node": "decode-node"}}
    params = post(ports["prefill"], body)["kv_transfer_params"]
    assert params["remote_prefix_tokens"] > 0

    def idle(sock: str) -> bool:
        got = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json"],
                             capture_output=True, text=True, env=engine_env(), cwd=ROOT, timeout=60)
        doc = json.loads(got.stdout)
        return doc["reservations"] == 0 and doc["leases"] == 0

    for name in ("prefill", "decode"):
        wait_until(lambda name=name: idle(sockets[name]), 30, f"the {name} node holding no slot")


def _pids_under(root: int) -> list[int]:
    """``root`` and every process descended from it, children first."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parents.items() if pp == p]
    return out[::-1]


def _server_pid(port: int) -> int:
    """The ``vllm serve`` (api_server) process listening on ``port``, by its command line."""
    return _pid_of(f"vllm api_server on port {port}",
                   lambda args: "vllm.entrypoints.openai.api_server" in args and str(port) in args)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_prefill_killed_with_its_saves_in_flight_releases_the_decode_wait_at_once(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    """The prefill server SIGKILLed while its saves of a long prompt are in flight: stopped
    (SIGSTOP) at a moment its node holds slots reserved for the prompt and not committed, then
    killed. The decode server is asked with the transfer parameters a prefill server answers for
    it (that answer may come before its saves land). The prefill node reclaims the dead engine's
    slots, its answer to the decode node's wait comes at once with the chunks that were committed
    (not after ``remote_prefill_wait_s``, 30 s), the decode server loads those and computes the
    rest, and its tokens equal a no-connector engine's; the prefill node counts the abandoned wait.

    The script's supervisor is paused meanwhile (it stops every server when one exits), so the
    decode server outlives the prefill server as it would on another machine. Last in the module:
    the prefill server is gone after it, and the supervisor then stops the rest."""
    from store_backend.node.client import NodeClient

    ports, sockets = cluster["ports"], cluster["sockets"]
    template = direct_leg(ports["prefill"], ports["decode"], prompt(681, 200)).params  # the node, address, fingerprint
    server = _server_pid(ports["prefill"])
    supervisor = os.getpgid(server)  # the script (its process group's leader)
    observer = NodeClient(sockets["prefill"], name="test-observer").start()
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True}}
    os.kill(supervisor, signal.SIGSTOP)
    try:
        caught = None
        for attempt in range(6):  # each try a fresh prompt; the stop lands while slots are held, or again
            p = prompt(690 + attempt, 3000)
            keys = [object_key(template["remote_fingerprint"], h) for h in chunk_hashes(p, CHUNK_TOKENS)]
            leg = threading.Thread(target=lambda p=p: _post_quiet(ports["prefill"], {**body, "prompt": p}), daemon=True)
            leg.start()
            while leg.is_alive() and caught is None:
                if observer.stats().slots.reservations:
                    pids = _pids_under(server)
                    _signal_all(pids, signal.SIGSTOP)
                    committed, reserved = observer.exists(keys), observer.exists(keys, count_reserved=True)
                    if reserved > committed:
                        caught = (p, keys, pids, committed)
                    else:
                        _signal_all(pids, signal.SIGCONT)
            if caught is not None:
                break
            leg.join(60)
        assert caught is not None, "the prefill server was never stopped with a save of the prompt in flight"
        p, keys, pids, committed = caught
        _signal_all(pids, signal.SIGKILL)
        wait_until(lambda: observer.stats().slots.reservations == 0, 30, "the killed engine's slots reclaimed")
        assert observer.exists(keys) == committed < len(keys)
        abandoned = _published(ports["redis"], "prefill-node").get("server_waits_abandoned", 0)
        params = {**template, "transfer_id": "killed-prefill", "remote_prefix_tokens": len(keys) * CHUNK_TOKENS}
        hits = metric(ports["decode"], "vllm:external_prefix_cache_hits_total")
        t0 = time.monotonic()
        out = post(ports["decode"], {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                     "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params})
        decode_s = time.monotonic() - t0
        got_hits = metric(ports["decode"], "vllm:external_prefix_cache_hits_total") - hits
        wait_until(lambda: _published(ports["redis"], "prefill-node").get("server_waits_abandoned", 0) > abandoned,
                   30, "the prefill node's heartbeat counting the abandoned wait")
    finally:
        observer.close()
        os.kill(supervisor, signal.SIGCONT)  # it now stops the rest (Redis too)
    assert decode_s < 10, decode_s  # answered at the reclaim, nowhere near remote_prefill_wait_s (30 s)
    assert out["choices"][0]["token_ids"] == baseline_tokens(tiny_model, cluster["work"], [p])[0]
    assert got_hits == committed * CHUNK_TOKENS, (got_hits, committed)


def _post_quiet(port: int, body: dict[str, Any]) -> None:
    """POST, ignoring the connection dying (the server is killed under it)."""
    try:
        post(port, body)
    except OSError:
        pass
