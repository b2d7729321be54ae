"""One owner per SSD directory and per named DRAM segment: advisory ``flock`` locks that say who holds them.

A store that opens an SSD directory takes an exclusive lock on ``<dir>/.owner.lock``; a named
``/dev/shm`` arena takes one on the segment's own descriptor. The lock lives as long as the
descriptor, so a process killed with SIGKILL releases it with its descriptors, and a second opener
(another process, or a second store in this one: ``flock`` locks belong to open file descriptions,
not to processes) is refused at once with :class:`OwnershipError` naming the path and the holder's
pid. Nothing of the holder's is touched before the lock is held: callers take it first and only then
truncate, resize, recover or delete anything.

A *shared* lock lets several processes use one directory on purpose (the file-per-key backend
under ``mooncake_connector.shared_ssd``); it excludes exclusive owners and they exclude it.

Called when a tier opens and closes (any thread, never on a hot path).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from store_backend.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".owner.lock"


class OwnershipError(ConfigError):
    """The directory or segment is held by another owner (the message names it and the pid)."""

    def __init__(self, message: str, path: str, holders: list[int]) -> None:
        super().__init__(message)
        self.path = path
        self.holders = holders


def lock_holders(fd: int) -> list[int]:
    """Pids holding a ``flock`` on the file open at ``fd`` (read from /proc/locks; [] if unknown)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF"; waiters carry a "->" field.
                if len(parts) >= 6 and parts[1] != "->" and parts[1] == "FLOCK" and parts[5] == ident:
                    pid = int(parts[4])
                    if pid > 0 and pid not in pids:
                        pids.append(pid)
    except (OSError, ValueError):
        pass
    return pids


def _describe(pids: list[int]) -> str:
    if not pids:
        return "another owner (pid unknown)"
    named = [f"pid {p}" + (" (this process)" if p == os.getpid() else "") for p in pids]
    return ", ".join(named)


def flock_or_raise(fd: int, path: str, what: str, *, shared: bool = False) -> None:
    """Take a non-blocking ``flock`` on ``fd`` or raise :class:`OwnershipError` naming the holders.

    ``what`` names the config field (``"ssd.path"``, ``"dram.shm_name"``) for the message. The
    caller owns ``fd`` either way (close it on error)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"{what}: cannot lock {path}: {e.strerror}") from None
        holders = lock_holders(fd)
        mode = "shared" if shared else "exclusive"
        raise OwnershipError(
            f"{what}: {path} is in use by {_describe(holders)}; one store owns it at a time "
            f"(wanted a {mode} lock)", path, holders) from None


class DirectoryLock:
    """The lock on one SSD directory, held from construction until :meth:`release`.

    Raises :class:`OwnershipError` when another owner holds it and :class:`ConfigError` naming
    ``field`` when the lock file cannot be made (not a directory, no permission, read-only).
    """

    def __init__(self, directory: str, *, field: str = "ssd.path", shared: bool = False) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self.shared = shared
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"{field}={directory!r}: cannot create the lock file {self.path}: "
                              f"{e.strerror}") from None
        try:
            flock_or_raise(self._fd, directory, field, shared=shared)
        except BaseException:
            os.close(self._fd)
            raise
        if not shared:
            # For people reading the directory; /proc/locks is what the error message trusts.
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass

    def release(self) -> None:
        """Drop the lock (idempotent). The lock file stays: unlinking it would race a new owner."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
