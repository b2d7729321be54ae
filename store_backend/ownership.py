"""One owner per SSD directory and per named DRAM segment: advisory ``flock`` locks that say who holds them.

A store that opens an SSD directory takes an exclusive lock on the directory itself (a descriptor
opened with ``O_DIRECTORY``: nobody can delete it from under the owner the way a lock *file* can be
deleted) and then one on ``<dir>/.owner.lock``, a note holding the owner's pid for people and for
read-only tools that look there; deleting the note lets nobody in. A named ``/dev/shm`` arena takes
one on a descriptor of the segment that is used for nothing else (never mapped, so a mapping that a
forked child inherits does not hold it). The lock lives as long as the descriptor, so a process
killed with SIGKILL releases it with its descriptors, and a second opener (another process, or a
second store in this one: ``flock`` locks belong to open file descriptions, not to processes) is
refused at once with :class:`OwnershipError` naming the path and the holder's pid. Nothing of the
holder's is touched before the lock is held: callers take it first and only then truncate, resize,
recover or delete anything.

A child made with ``fork()`` (multiprocessing's fork start method, a pool) would inherit the lock
descriptors and keep the lock after its parent dies; every held lock is closed in such a child at
once (``os.register_at_fork``), so a restarted owner is not refused by a helper of the dead one.
Locks taken by a process that was forked from *outside* Python (or a descriptor passed on) can still
outlive their taker: the message then says that the named pid has exited.

A *shared* lock lets several processes use one directory on purpose (the file-per-key backend
under ``store_backend.ssd.shared_directory``); it excludes exclusive owners and they exclude it.

Called when a tier opens and closes (any thread, never on a hot path).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import weakref

from store_backend.config import ConfigError
from store_backend.private import open_private

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
    return [pid for pid, _ in flock_holders(fd)]


def flock_holders(fd: int) -> list[tuple[int, bool]]:
    """(pid, exclusive) of each holder of a ``flock`` on the file open at ``fd`` (from /proc/locks;
    [] if unknown). Reads only."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out: list[tuple[int, bool]] = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF"; waiters carry a "->" field.
                if len(parts) >= 6 and parts[1] != "->" and parts[1] == "FLOCK" and parts[5] == ident:
                    pid = int(parts[4])
                    if pid > 0 and all(p != pid for p, _ in out):
                        out.append((pid, parts[3] == "WRITE"))
    except (OSError, ValueError):
        pass
    return out


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this pid namespace (signal 0; one owned by another user
    counts as alive). Never blocks."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def _describe(pids: list[int]) -> str:
    if not pids:
        return "another owner (pid unknown)"
    named = []
    for p in pids:
        if p == os.getpid():
            named.append(f"pid {p} (this process)")
        elif not pid_alive(p):
            # /proc/locks names the pid that took the lock; a descriptor it handed on keeps it.
            named.append(f"pid {p} (pid {p} has exited; a process it forked may still hold it)")
        else:
            named.append(f"pid {p}")
    return ", ".join(named)


class HeldLock:
    """A descriptor that holds a ``flock`` and is closed in every child this process forks.

    Owns ``fd`` from construction: :meth:`close` (idempotent) drops the lock. Thread-safe."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._mu = threading.Lock()
        _track(self)

    @property
    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        with self._mu:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _forget_in_child(self) -> None:
        # The lock belongs to the open file description the parent shares; the child only drops
        # its reference (never LOCK_UN, which would unlock the parent too).
        fd, self._fd = self._fd, -1
        self._mu = threading.Lock()  # a lock copied mid-acquire from another thread would never open
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


_held: weakref.WeakSet[HeldLock] = weakref.WeakSet()
_hook_installed = False
_registry_mu = threading.Lock()


def _track(lock: HeldLock) -> None:
    global _hook_installed
    with _registry_mu:
        _held.add(lock)
        if not _hook_installed:
            os.register_at_fork(after_in_child=_close_all_in_child)
            _hook_installed = True


def _close_all_in_child() -> None:
    global _registry_mu
    _registry_mu = threading.Lock()  # another thread may have held it at the fork
    for lock in list(_held):
        lock._forget_in_child()


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

    The directory's own lock is the one that counts; ``.owner.lock`` is locked after it, in the same
    mode, so read-only tools that lock the note keep seeing the owner, and it holds the owner's pid.
    Raises :class:`OwnershipError` when another owner holds either and :class:`ConfigError` naming
    ``field`` when the directory cannot be opened or the note cannot be made (no permission,
    read-only).
    """

    def __init__(self, directory: str, *, field: str = "ssd.path", shared: bool = False) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self.shared = shared
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"{field}={directory!r}: cannot open the directory: {e.strerror}") from None
        try:
            flock_or_raise(dir_fd, directory, field, shared=shared)
        except BaseException:
            os.close(dir_fd)
            raise
        self._dir = HeldLock(dir_fd)
        try:
            try:
                fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            except OSError as e:
                raise ConfigError(f"{field}={directory!r}: cannot create the lock file {self.path}: "
                                  f"{e.strerror}") from None
            try:
                flock_or_raise(fd, directory, field, shared=shared)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._dir.close()
            raise
        self._note = HeldLock(fd)
        if not shared:
            # For people reading the directory; /proc/locks is what the error message trusts.
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass

    def release(self) -> None:
        """Drop the lock (idempotent). The note stays: unlinking it would race a new owner's note."""
        self._note.close()
        self._dir.close()
