"""A node service for the benches (``bench node``, ``bench pool``): ``python -m store_backend.node
serve`` in a subprocess with a config of its own in a private directory, removed at close with its
log. Started and stopped from the bench's own thread."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from store_backend.node.launch import spawn_service, wait_answering


class BenchNodeService:
    """One node service with ``capacity_bytes`` of DRAM (and ``pool``, a pool section, if given);
    the constructor blocks until it answers on ``socket``, or closes it and raises RuntimeError with
    the end of its log after ``start_timeout_s`` or when it exits. ``prefix``: a command it runs
    under (``ip netns exec NAME``: another host's network, the same files and shared memory)."""

    def __init__(self, capacity_bytes: int, start_timeout_s: float, *, name: str | None = None,
                 pool: dict[str, Any] | None = None, verify_reads: bool = False,
                 prefix: Sequence[str] = ()) -> None:
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
            self.proc = spawn_service(config, log, prefix=prefix)
        what = f"node service {name}" if name else "the node service"
        try:
            wait_answering(self.socket, self.proc, start_timeout_s, self.log, what=what)
        except RuntimeError as e:
            self.close()  # removes the log, whose end the error carries
            raise RuntimeError(f"{what} did not start: {e}") from None

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
