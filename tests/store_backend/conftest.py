from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store_backend.api import KVStore
from store_backend.node.client import NodeClient
from store_backend.node.server import NodeService
from store_backend.store import TieredStore


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic bytes for a key, so any reader can check what it got."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root with ``mount`` on PATH)."""
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``mount -o size=``, e.g. ``"64m"``) at the new directory ``mnt``.

    Skips the test when the mount is refused. Unmounts on exit, lazily if something still holds it.
    """
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def short_socket_dir() -> Path:
    """A new private (0700) directory under /tmp for a node service's socket: pytest's tmp_path can
    be longer than an AF_UNIX address allows (107 bytes). The caller removes it."""
    return Path(tempfile.mkdtemp(prefix="mkv-"))


class ServedClient(NodeClient):
    """A :class:`NodeClient` of a :class:`NodeService` that serves on a thread of this process (the
    contract suites' "node" implementation): closing the client stops the service, and removes its
    socket directory."""

    def __init__(self, service: NodeService, socket_dir: Path) -> None:
        super().__init__(service.socket_path, name="contract-suite", op_timeout_s=30.0)
        self.service = service
        self.socket_dir = socket_dir

    def close(self, flush: bool = True, timeout_s: float = 60.0) -> None:
        try:
            super().close(flush=flush, timeout_s=timeout_s)
        finally:
            self.service.stop(timeout_s=timeout_s)
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def serve_node(config: Mapping[str, Any], **service_config: Any) -> ServedClient:
    """A NodeService over the store ``config`` (a StoreConfig mapping; its arena a fresh segment of
    a name of its own) on a thread of this process, socket in a new private directory, no
    /metrics; and a started client of it, mapping the segment from the fd the service passed."""
    socket_dir = short_socket_dir()
    store = dict(config)
    store["dram"] = {**store.get("dram", {}), "shm_name": f"mkv-contract-{uuid.uuid4().hex[:12]}"}
    node_config = {"store": store, "socket": str(socket_dir / "node.sock"), "metrics": None,
                   "drain_timeout_s": 2.0, **service_config}
    try:
        service = NodeService(node_config).run_in_thread()
    except BaseException:
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    client = ServedClient(service, socket_dir)
    try:
        return client.start()  # type: ignore[return-value]
    except BaseException:
        client.close(flush=False, timeout_s=10)
        raise


# The KVStore implementations the contract suite runs against: the embedded store, and a client of
# a node service (its bytes through the shared segment, its calls over the socket).
STORE_IMPLEMENTATIONS = ["embedded", "node"]


@pytest.fixture(params=STORE_IMPLEMENTATIONS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[[Mapping[str, Any]], KVStore]]:
    """A factory: ``make_store(config)`` returns a started :class:`~store_backend.api.KVStore` of the
    parametrised implementation over ``config`` (a StoreConfig mapping). Every store it made is
    closed at teardown (close is idempotent, so a test may close it itself)."""
    made: list[KVStore] = []

    def make(config: Mapping[str, Any]) -> KVStore:
        if request.param == "embedded":
            s: KVStore = TieredStore(config).start()
        elif request.param == "node":
            s = serve_node(config)
        else:  # pragma: no cover - a new implementation must be added here
            raise AssertionError(f"no store implementation {request.param!r}")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(flush=False, timeout_s=30)
