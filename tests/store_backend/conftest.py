from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest


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
