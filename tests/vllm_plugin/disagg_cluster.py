"""Real vLLM OpenAI servers for the disaggregated (1P1D) e2e tests, and the example proxy in front.

:func:`disagg_cluster` starts a prefill (``kv_producer``) and a decode (``kv_consumer``) server, waits
until both answer ``/health``, starts ``examples/vllm_disagg/proxy.py`` in front of them and stops all
three on exit. The servers are whatever the caller's ``start_server`` makes (the tests differ in their
connector config and batch size). The HTTP helpers block; none is thread-safe beyond what urllib is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.node_service import ServiceRun
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, store_section

MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 400

# (port, kv_role, log path) -> the started server process
StartServer = Callable[[int, str, Path], subprocess.Popen]


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


def vllm_server(model: Path, port: int, role: str, ssd: Path, log: Path, *,
                extra_config: dict[str, Any] | None = None, args: Sequence[str] = ()) -> subprocess.Popen:
    """A vLLM OpenAI server on ``port`` with this connector as ``role``, sharing the SSD directory
    ``ssd``; ``extra_config`` adds connector keys, ``args`` adds server flags. Output goes to ``log``."""
    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_role": role,
           "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "shared_ssd": True, **(extra_config or {}),
                                         "store": store_section(ssd)}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--block-size", "32", "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", *args,
           "--kv-transfer-config", json.dumps(ktc)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env(), cwd=ROOT)


def node_service_server(model: Path, port: int, svc: ServiceRun, log: Path) -> subprocess.Popen:
    """A vLLM OpenAI server on ``port`` with this connector (kv_both) attached to the node service
    ``svc``. Output goes to ``log``."""
    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "store": svc.attach()}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           "tiny", "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--block-size", "32",
           "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--kv-transfer-config", json.dumps(ktc)]
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


@contextmanager
def disagg_cluster(work: Path, start_server: StartServer) -> Iterator[dict[str, int]]:
    """Prefill and decode servers from ``start_server`` and the example proxy, logging under ``work``.

    Yields the ports (``"prefill"``, ``"decode"``, ``"proxy"``); a server that exits before it is
    healthy fails with its log. Every process is stopped on exit."""
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    logs = [work / "prefill.log", work / "decode.log"]
    servers = [start_server(ports["prefill"], "kv_producer", logs[0]),
               start_server(ports["decode"], "kv_consumer", logs[1])]
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
        yield ports
    finally:
        stop(procs)


SERVER_FLAGS = ("--served-model-name tiny --host 127.0.0.1 --skip-tokenizer-init --block-size 32 --dtype float32 "
                "--max-model-len 4096 --enforce-eager")


@contextmanager
def example_cluster(work: Path, model: Path) -> Iterator[dict[str, int]]:
    """``examples/vllm_disagg/run_1p1d.sh`` as a user runs it (both servers and the proxy), on ``model``
    with the CPU build's flags, its SSD directory and logs under ``work``.

    Yields the ports, as :func:`disagg_cluster` does; the script exiting before the proxy is healthy
    fails with its log. The whole process group is stopped (SIGTERM, then SIGKILL) on exit."""
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    log = work / "run_1p1d.log"
    env = {**engine_env(), "MODEL": str(model), "SSD_DIR": str(work / "ssd"), "CHUNK_TOKENS": str(CHUNK_TOKENS),
           "DRAM": "64MiB", "PREFILL_PORT": str(ports["prefill"]), "DECODE_PORT": str(ports["decode"]),
           "PROXY_PORT": str(ports["proxy"]), "EXTRA_ARGS": SERVER_FLAGS,
           "MOONCAKE_KV_VENV": sys.prefix}
    script = subprocess.Popen(["bash", str(ROOT / "examples" / "vllm_disagg" / "run_1p1d.sh")], env=env, cwd=ROOT,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{ports['proxy']}", [script], [log])
        yield ports
    finally:
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(script.pid, sig)
            except ProcessLookupError:
                break
            try:
                script.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


def complete(port: int, token_ids: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # name what the server said, not just its status
        raise AssertionError(f"POST :{port}/v1/completions answered {e.code}: {e.read()[:2000]!r}") from e


def engine_warnings(log: Path, limit: int = 40) -> str:
    """The last ``limit`` WARNING/ERROR lines an engine core or worker wrote to the server log
    ``log`` (the connector's reports of failed loads and saves land there), for failure messages."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if ("WARNING" in ln or "ERROR" in ln) and "APIServer" not in ln and "base.py:214" not in ln]
    return "\n".join(lines[-limit:]) or "(none)"


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE):
        total += float(m.group(1))
    return total
