"""Disaggregated prefill/decode (1P1D) through the example proxy, two real vLLM OpenAI servers.

The prefill server (``kv_producer``) and the decode server (``kv_consumer``) share one SSD directory
(``shared_ssd``). The proxy sends each request to prefill with ``max_tokens=1``, then to decode with
the returned ``kv_transfer_params``. The decode server must answer with exactly the tokens of a
no-connector engine, and its own metrics must show that it loaded the prefix from the store rather
than recomputing it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(31, 700), prompt(32, 300)]
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise AssertionError(f"{log.name} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} not healthy after {STARTUP_TIMEOUT_S} s")


def vllm_server(model: Path, port: int, role: str, ssd: Path, log: Path) -> subprocess.Popen:
    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_role": role,
           "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "shared_ssd": True,
                                         "store": store_section(ssd)}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--block-size", "32",
           "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
           "--kv-transfer-config", json.dumps(ktc)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env(), cwd=ROOT)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("disagg")
    ssd = work / "ssd"
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    logs = [work / "prefill.log", work / "decode.log"]
    servers = [vllm_server(tiny_model, ports["prefill"], "kv_producer", ssd, logs[0]),
               vllm_server(tiny_model, ports["decode"], "kv_consumer", ssd, logs[1])]
    procs = list(servers)
    try:
        for name in ("prefill", "decode"):
            wait_healthy(f"http://127.0.0.1:{ports[name]}", servers, logs)
        proxy_log = work / "proxy.log"
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "vllm_disagg" / "proxy.py"), "--port", str(ports["proxy"]),
             "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode", f"http://127.0.0.1:{ports['decode']}"],
            stdout=open(proxy_log, "w"), stderr=subprocess.STDOUT, env={**os.environ}))
        wait_healthy(f"http://127.0.0.1:{ports['proxy']}", procs[2:], [proxy_log])
        yield {"ports": ports, "work": work}
    finally:
        stop(procs)


def complete(port: int, token_ids: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE):
        total += float(m.group(1))
    return total


def test_decode_server_loads_the_prefilled_prefix_and_matches_baseline(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    outputs = [complete(cluster["ports"]["proxy"], p) for p in PROMPTS]
    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in PROMPTS]},
                          cluster["work"], "baseline")
    assert [o["choices"][0]["token_ids"] for o in outputs] == [r[0]["tokens"] for r in baseline["rounds"]]

    # The decode server's own counters: every whole chunk of each prompt (short of its last token)
    # came from the store, and only the tails were computed there.
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS)
    decode = cluster["ports"]["decode"]
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == want_hits
    assert metric(decode, "vllm:prefix_cache_hits_total") == 0  # nothing came from its local cache
    # The prefill server saw each prompt once and hit nothing (it had nothing to reuse).
    assert metric(cluster["ports"]["prefill"], "vllm:external_prefix_cache_hits_total") == 0
