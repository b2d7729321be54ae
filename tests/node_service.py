"""A real node service for the engine tests: ``python -m store_backend.node serve`` in a subprocess.

Each test gets its own socket in a short private directory (an AF_UNIX path holds 107 bytes, pytest's
tmp paths may not fit), its own segment name, its config file and log under the test's work
directory. :class:`ServiceRun` starts, SIGKILLs, restarts and stops it, and asks it for its status
(``status --json``) the way an operator would. Blocking; not thread-safe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from store_backend.dram import unlink_leftover_segments
from store_backend.node.launch import spawn_service

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0


def service_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def short_socket_dir() -> str:
    """A fresh 0700 directory with a short path, for a socket."""
    return tempfile.mkdtemp(prefix="mkv-", dir="/tmp")


class ServiceRun:
    """One node service config, run (and re-run) as a subprocess."""

    def __init__(self, work: Path, store: dict[str, Any], *, name: str = "node",
                 sections: dict[str, Any] | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.socket_dir = short_socket_dir()
        self.socket = os.path.join(self.socket_dir, "node.sock")
        store = json.loads(json.dumps(store))
        store.setdefault("dram", {}).setdefault("shm_name", f"mkv-test-{uuid.uuid4().hex[:12]}")
        # ``sections``: more of the node config (e.g. ``events``).
        self.config = {"store": store, "socket": self.socket, "metrics": None, **(sections or {})}
        self.config_path = work / f"{name}.json"
        self.config_path.write_text(json.dumps(self.config))
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def attach(self, **more: Any) -> dict[str, Any]:
        """The connector's ``store`` section that attaches to this service."""
        return {"node": {"socket": self.socket, **more}}

    def start(self) -> ServiceRun:
        """Start ``serve`` and wait until ``status`` says it is ready (raises with the log if not)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "a")
        log.write(f"---- start {self.starts}\n")
        log.flush()
        self.proc = spawn_service(self.config_path, log, env=service_env(), cwd=ROOT)
        log.close()
        self.starts += 1
        got = self.cli("status", "--json", "--wait", str(READY_TIMEOUT_S), check=False)
        if got.returncode != 0:
            self.kill()
            raise AssertionError(f"node service not ready (status rc={got.returncode}: {got.stdout}{got.stderr}); "
                                 f"log {self.log_path}:\n{self.log_path.read_text()[-4000:]}")
        return self

    def cli(self, command: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``python -m store_backend.node COMMAND --socket S ARGS`` (what ``mooncake-kv`` runs)."""
        got = subprocess.run([sys.executable, "-m", "store_backend.node", command, "--socket", self.socket, *args],
                             capture_output=True, text=True, env=service_env(), cwd=ROOT, timeout=READY_TIMEOUT_S + 30)
        if check and got.returncode != 0:
            raise AssertionError(f"{command} rc={got.returncode}: {got.stdout}{got.stderr}")
        return got

    def status(self) -> dict[str, Any]:
        return json.loads(self.cli("status", "--json").stdout)

    def kill(self) -> None:
        """SIGKILL the service (no drain, no flush) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 180.0) -> int | None:
        """SIGTERM (drain, flush to SSD), then SIGKILL after ``timeout_s``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def close(self) -> None:
        """Stop the service, remove its socket directory and any arena segment of it left in
        /dev/shm (a service killed with SIGKILL never unlinks its own)."""
        self.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        shm = self.config["store"].get("dram", {}).get("shm_name")
        if shm:
            unlink_leftover_segments(shm)


@contextmanager
def node_service(work: Path, store: dict[str, Any], *, name: str = "node",
                 sections: dict[str, Any] | None = None) -> Iterator[ServiceRun]:
    """A started node service with ``store`` (a StoreConfig mapping) and ``sections`` (more of its
    config), stopped on exit."""
    run = ServiceRun(work, store, name=name, sections=sections)
    try:
        yield run.start()
    finally:
        run.close()
