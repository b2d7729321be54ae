"""Shared pieces of the vLLM end-to-end tests: the tiny model, engine processes, prompts.

Every engine runs in a fresh process (``engine_runner.py``), so reuse between engines can only come
through the store, exactly as between two vLLM deployments. The processes are forked from one
server per test session that has already imported torch and vLLM (``engine_forkserver.py``), which
saves each engine about ten seconds; ``MOONCAKE_KV_TEST_FRESH_ENGINES=1`` starts each one with a
new interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from tests.processes import stop  # noqa: E402
from tests.vllm_plugin.tiny_model import write_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("engine_runner.py")
ENGINE_TIMEOUT_S = 420
FORKSERVER_START_S = 180
CHUNK_TOKENS = 64  # two 32-token blocks per stored object


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def run_engine(spec: dict[str, Any], work: Path, name: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine process on ``spec`` (``env``: extra environment variables); return its RESULT
    (raises with its log on failure)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"{name}.log"
    if os.environ.get("MOONCAKE_KV_TEST_FRESH_ENGINES") == "1":
        with open(log_path, "w") as log:
            try:
                rc: int | str = subprocess.run([sys.executable, str(RUNNER), str(spec_path)], stdout=log,
                                               stderr=subprocess.STDOUT, env={**engine_env(), **(env or {})},
                                               cwd=ROOT, timeout=ENGINE_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                rc = f"timed out after {ENGINE_TIMEOUT_S} s"
    else:
        rc = _forkserver().run(spec_path, log_path, env or {})
    out = log_path.read_text() if log_path.exists() else "(no log)"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise AssertionError(f"engine {name} failed (rc={rc}), log {log_path}:\n{out[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


class _ForkServer:
    """The session's engine fork server (``engine_forkserver.py``): started on first use, stopped
    when the session ends (its stdin closes with this process, so it cannot outlive a killed run)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="mkv-engines-")
        self.sock = os.path.join(self.dir, "fork.sock")
        self.log = os.path.join(self.dir, "forkserver.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_plugin.engine_forkserver", self.sock],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         env=engine_env(), cwd=ROOT)
        deadline = time.monotonic() + FORKSERVER_START_S
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"the engine fork server did not start (rc={self.proc.returncode}) in "
                                     f"{FORKSERVER_START_S} s:\n{Path(self.log).read_text()[-6000:]}")
            time.sleep(0.05)  # polling the condition above, which has its deadline

    def run(self, spec_path: Path, log_path: Path, env: dict[str, str]) -> int | str:
        """Fork one engine process for ``spec_path``; its exit code, or why there is none."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(ENGINE_TIMEOUT_S)
        pid = None
        try:
            conn.connect(self.sock)
            f = conn.makefile("rwb", buffering=0)
            f.write((json.dumps({"argv": [str(spec_path)], "log": str(log_path), "env": env, "cwd": str(ROOT)})
                     + "\n").encode())
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            while True:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                line = f.readline()
                if not line:
                    return "the engine process ended without an exit code (killed by a signal?)"
                msg = json.loads(line)
                if "pid" in msg:
                    pid = msg["pid"]
                elif "rc" in msg:
                    return int(msg["rc"])
        except (TimeoutError, socket.timeout):
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return f"timed out after {ENGINE_TIMEOUT_S} s"
        finally:
            conn.close()

    def close(self) -> None:
        stop(self.proc, kill_wait_s=10)
        shutil.rmtree(self.dir, ignore_errors=True)


_FORKSERVER: _ForkServer | None = None
_FORKSERVER_LOCK = threading.Lock()


def _forkserver() -> _ForkServer:
    global _FORKSERVER
    with _FORKSERVER_LOCK:
        if _FORKSERVER is None or _FORKSERVER.proc.poll() is not None:
            _FORKSERVER = _ForkServer()
            atexit.register(_FORKSERVER.close)
        return _FORKSERVER


def prompt(seed: int, length: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def store_section(ssd_path: Path, *, dram: str = "64MiB", backend: str = "file") -> dict[str, Any]:
    """An embedded store whose SSD directory outlives the engine (eager offload)."""
    return {
        "dram": {"capacity_bytes": dram},
        "ssd": {"path": str(ssd_path), "capacity_bytes": "1GiB", "backend": backend},
        "offload": {"policy": "eager"},
    }


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
