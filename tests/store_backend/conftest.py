from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store_backend.api import KVStore
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


# The KVStore implementations the contract suite runs against. The node service's client joins
# as "node" once it exists; every test taking ``make_store`` then runs against both.
STORE_IMPLEMENTATIONS = ["embedded"]


@pytest.fixture(params=STORE_IMPLEMENTATIONS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[[Mapping[str, Any]], KVStore]]:
    """A factory: ``make_store(config)`` returns a started :class:`~store_backend.api.KVStore` of the
    parametrised implementation over ``config`` (a StoreConfig mapping). Every store it made is
    closed at teardown (close is idempotent, so a test may close it itself)."""
    made: list[KVStore] = []

    def make(config: Mapping[str, Any]) -> KVStore:
        if request.param == "embedded":
            s: KVStore = TieredStore(config).start()
        else:  # pragma: no cover - a new implementation must be added here
            raise AssertionError(f"no store implementation {request.param!r}")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(flush=False, timeout_s=30)
