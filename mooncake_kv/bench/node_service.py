"""A node service for the benches (``bench node``, ``bench pool``): ``python -m store_backend.node
serve`` in a subprocess with a config of its own in a private directory, removed at close with its
log. Started and stopped from the bench's own thread."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from store_backend.node.client import probe


class BenchNodeService:
    """One node service with ``capacity_bytes`` of DRAM (and ``pool``, a pool section, if given);
    the constructor blocks until it answers on ``socket``, or closes it and raises RuntimeError with
    the end of its log after ``start_timeout_s`` or when it exits."""

    def __init__(self, capacity_bytes: int, start_timeout_s: float, *, name: str | None = None,
                 pool: dict[str, Any] | None = None, verify_reads: bool = False) -> None:
        self.name = name
        self.directory = Path(tempfile.mkdtemp(prefix=f"mkv-bench-{name}-" if name else "mkv-bench-"))
        self.socket = str(self.directory / "node.sock")
        doc: dict[str, Any] = {
            "store": {"dram": {"capacity_bytes": capacity_bytes, "shm_name": f"mkv-bench-{uuid.uuid4().hex[:10]}"}},
            "socket": self.socket, "metrics": None, "verify_reads": verify_reads}
        if pool is not None:
            doc["pool"] = pool
        config = self.directory / "node.json"
        # 0600: the pool section may hold a secret (a password in the Redis url), and the service
        # refuses a config file holding one that others may read.
        with os.fdopen(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(json.dumps(doc))
        self.log = self.directory / "node.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "store_backend.node", "serve", "--config", str(config)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while probe(self.socket) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]  # before close removes it
                self.close()
                what = f"node service {name}" if name else "the node service"
                raise RuntimeError(f"{what} did not start: {tail}")
            time.sleep(0.05)

    def close(self) -> None:
        """SIGTERM and wait up to 60 s (then SIGKILL); remove the directory. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)
