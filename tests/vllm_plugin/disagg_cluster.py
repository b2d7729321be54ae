"""Real vLLM OpenAI servers for the disaggregated (1P1D) e2e tests, started by the example scripts
as a user starts them (:func:`script_cluster`, :func:`example_cluster`), and the HTTP helpers the
tests ask them with. The helpers block; none is thread-safe beyond what urllib is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from tests.node_service import ServiceRun
from tests.ports import free_port, free_ports  # noqa: F401  (re-exported for the e2e tests)
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, run_engine

MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 400


# Ports handed to servers that bind them a minute later come from below the kernel's ephemeral range
# (ip_local_port_range, 32768-60999 by default): a port from bind(0) can meanwhile become the local
# end of one of the servers' own connections, and the server started last then fails to bind it.
class PortClash(AssertionError):
    """A process exited before it was healthy because a port it was given was taken meanwhile."""


def _exited(proc: subprocess.Popen, log: Path) -> AssertionError:
    text = log.read_text(errors="replace")
    kind = PortClash if "address already in use" in text.lower() else AssertionError
    return kind(f"{log.name} exited with {proc.returncode}:\n{text[-4000:]}")


def wait_healthy(url: str, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait until ``url``/health answers 200. A process of ``procs`` that exits first fails with its
    log (:class:`PortClash` when the log says a port was taken); after :data:`STARTUP_TIMEOUT_S` it
    fails with the tail of every log."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise _exited(proc, log)
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)  # poll interval; the loop has a deadline
    tails = "\n".join(f"--- {log.name} (last 4000 characters) ---\n{log.read_text(errors='replace')[-4000:]}"
                      for log in logs if log.exists())
    raise AssertionError(f"{url} not healthy after {STARTUP_TIMEOUT_S} s; every process is still running\n{tails}")


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


SERVER_FLAGS = ("--served-model-name tiny --host 127.0.0.1 --skip-tokenizer-init --block-size 32 --dtype float32 "
                "--max-model-len 4096 --enforce-eager")


@contextmanager
def script_cluster(script: Path, work: Path, env: dict[str, str], *, stop_wait_s: float = 60,
                   attempts: int = 2, ports: Sequence[str] = ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT"),
                   healthy: Sequence[str] = ("PROXY_PORT",)) -> Iterator[dict[str, int]]:
    """``script`` (an example that starts servers, by default a prefill server, a decode server and
    the proxy) run as a user runs it, with ``env`` added to its environment and a free port in each
    variable of ``ports``; its output goes to ``work/<script stem>.log``.

    Yields the ports by name (the variable without ``_PORT``, lower case: ``"prefill"``, ``"decode"``,
    ``"proxy"``) once every server of ``healthy`` answers /health. The script exiting first fails
    with its log, except that a port taken meanwhile (:class:`PortClash`) starts it again on fresh
    ports, up to ``attempts`` times. The script's whole process group is stopped on exit (SIGTERM,
    ``stop_wait_s`` for it to clean up, then SIGKILL)."""
    def name(var: str) -> str:
        return var.removesuffix("_PORT").lower()

    for attempt in range(1, attempts + 1):
        got = free_ports(*ports)
        log = work / (f"{script.stem}.log" if attempt == 1 else f"{script.stem}.{attempt}.log")
        proc = subprocess.Popen(["bash", str(script)], env={**env, **{var: str(port) for var, port in got.items()}},
                                cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                for var in healthy:
                    wait_healthy(f"http://127.0.0.1:{got[var]}", [proc], [log])
            except PortClash:
                if attempt == attempts:
                    raise
                continue
            yield {name(var): port for var, port in got.items()}
            return
        finally:
            _stop_group(proc, stop_wait_s)


def _stop_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM to the script's whole process group, ``wait_s`` for every process of it to end (not
    just the script: it may have exited already), then SIGKILL to what is left."""
    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the script itself, or the group never empties
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)  # poll interval; the loop has a deadline
    proc.wait(timeout=30)


@contextmanager
def example_cluster(work: Path, model: Path, *, env: dict[str, str] | None = None,
                    args: str = "") -> Iterator[dict[str, int]]:
    """``examples/vllm_disagg/run_1p1d.sh`` as a user runs it (both servers and the proxy), on ``model``
    with the CPU build's flags (and ``args``), its SSD directory and logs under ``work``, ``env``
    added to its environment (``MOONCAKE_KV_*`` connector settings, as a user may set them); see
    :func:`script_cluster`. The decode server loads every prefix beside its steps
    (``remote_prefill_load: async``, by the environment): the proxy's requests come one at a time,
    which "auto" would load in their step (the other P/D clusters cover that)."""
    env = {**engine_env(), "MODEL": str(model), "SSD_DIR": str(work / "ssd"), "CHUNK_TOKENS": str(CHUNK_TOKENS),
           "DRAM": "64MiB", "EXTRA_ARGS": f"{SERVER_FLAGS} {args}".strip(), "MOONCAKE_KV_VENV": sys.prefix,
           "MOONCAKE_KV_REMOTE_PREFILL_LOAD": "async", **(env or {})}
    with script_cluster(ROOT / "examples" / "vllm_disagg" / "run_1p1d.sh", work, env) as ports:
        yield ports


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


class DirectLeg(NamedTuple):
    """The decode leg sent by a test itself (see :func:`direct_leg`)."""

    params: dict[str, Any]  # what the prefill server answered in kv_transfer_params
    tokens: list[int]  # the decode server's answer
    decode_s: float  # how long the decode server took
    hits: float  # its external prefix-cache hits for this request


def direct_leg(prefill_port: int, decode_port: int, token_ids: list[int]) -> DirectLeg:
    """Prefill ``token_ids`` (one token, ``do_remote_decode``), then ask the decode server at once
    with the transfer parameters the prefill server answered (its saves may still be in flight)."""
    body = {"model": "tiny", "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    hits = "vllm:external_prefix_cache_hits_total"
    before = metric(decode_port, hits)
    params = post(prefill_port, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})[
        "kv_transfer_params"]
    t0 = time.monotonic()
    out = post(decode_port, {**body, "kv_transfer_params": params})
    decode_s = time.monotonic() - t0
    return DirectLeg(params, out["choices"][0]["token_ids"], decode_s, metric(decode_port, hits) - before)


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the server's /v1/completions; its JSON answer."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def baseline_tokens(model: Path, work: Path, prompts: Sequence[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens from a no-connector engine (one round per prompt)."""
    baseline = run_engine({"model_dir": str(model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in prompts]}, work, "baseline")
    return [r[0]["tokens"] for r in baseline["rounds"]]
