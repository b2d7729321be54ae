"""The node service's ``node.lock`` (one service per socket directory) and how a path's file kind is
named in errors.
"""

from __future__ import annotations

import os
import stat

from store_backend.config_loader import ConfigError
from store_backend.ownership import HeldLock, OwnershipError, flock_or_raise


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def take_node_lock(path: str) -> HeldLock:
    """The service's ``node.lock`` (flock, holds our pid); ConfigError naming the holder's pid when
    another service has it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ConfigError(f"socket: cannot open the lock file {path}: {e.strerror}") from None
    try:
        flock_or_raise(fd, path, "socket")
    except OwnershipError as e:
        os.close(fd)
        who = ", ".join(f"pid {pid}" for pid in e.holders) or "a process"
        raise OwnershipError(f"socket: another node service ({who}) holds {path}: one service per socket "
                             f"directory; stop it first (mooncake-kv stop --socket "
                             f"{os.path.join(os.path.dirname(path), 'node.sock')})", e.path, e.holders) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return HeldLock(fd)
