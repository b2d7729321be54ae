"""The cache epoch of a store directory, and removal of the keys of epochs that are over.

A connector's cache reset (vLLM's ``reset_prefix_cache(reset_connector=True)``, a weight update)
must make everything stored so far unreachable at once. Rather than deleting every object before
answering, the epoch is part of the key fingerprint: a reset moves to the next epoch (new keys from
then on) and the old epoch's objects are removed in the background by :class:`EpochSweeper`.

The epoch must survive a restart, or KV stored before a reset would be found again at epoch 0 after
a crash: :class:`EpochFile` keeps it in ``<ssd.path>/mooncake-kv-epoch`` (JSON ``{"epoch": N,
"reset": bool}``; mode 0600, in a directory nobody else may write: a planted older epoch would serve
KV from before a reset), written atomically (temporary file, fsync, rename, fsync of the directory)
under an exclusive ``flock`` of ``mooncake-kv-epoch.lock`` beside it, and it only ever grows,
whichever process of the node advances it. The SSD backends ignore files whose names are not theirs,
and with several ranks the configured ``ssd.path`` holds one subdirectory per rank, so these two
files sit beside them. A store without an SSD tier loses everything on a restart anyway: its epoch
lives in memory.

An epoch created by a reset is never reused by a restart. A reset usually follows a weight update
made in memory (an RL weight sync, ``collective_rpc``): the KV saved after it was computed with
weights the fingerprint cannot name (it stamps the checkpoint on disk), and an engine started later
loads the disk weights again. So ``"reset": true`` marks such an epoch, and :meth:`EpochFile.start`
(called once when an engine starts) moves past it to a fresh epoch (``"reset": false``), whose KV
belongs to the weights the fingerprint names and is reused by later restarts. A file written before
the flag existed (``{"epoch": N}``, N > 0) was written by a reset and is read as one.

``EpochFile`` is called from an engine's scheduler thread (rarely: start-up and resets);
``EpochSweeper`` owns one background thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from store_backend.api import KVStore
from store_backend.config import ConfigError
from store_backend.ownership import lock_holders
from store_backend.private import ensure_private_dir, open_private
from store_backend.threads import Deadline, Workers
from store_backend.types import Status

logger = logging.getLogger(__name__)

EPOCH_FILE = "mooncake-kv-epoch"
LOCK_FILE = EPOCH_FILE + ".lock"
# A write goes to ``<EPOCH_FILE>.<pid>.partial`` first; one left by a crash is removed under the lock
# (by a start that needs no lock only when the lock is free at once).
PARTIAL_SUFFIX = ".partial"

# How long a start or a reset waits for another process's hold of the epoch lock (a few fsyncs
# normally) before it gives up with an error naming the holder.
DEFAULT_LOCK_TIMEOUT_S = 30.0

# How many digests of retired epochs a sweeper remembers and sweeps again with every later sweep.
_RETIRED_MAX = 64


class EpochFile:
    """The persisted epoch of the store directory ``directory`` (None: no SSD tier, in memory).

    Not thread-safe on its own (one caller thread); safe between processes (``flock``). The lock
    is waited for at most ``lock_timeout_s``: past that, ConfigError naming the lock file and the
    pid holding it (a hung or stopped process), instead of hanging the engine's start or reset.
    A temporary file that a crash left in the middle of a write is never read as the epoch, and is
    removed at the next write or :meth:`start`, under the lock so no live writer's is touched; a
    start that needs no lock removes them only if the lock is free at once (best-effort: it never
    waits for the lock nor fails for them)."""

    def __init__(self, directory: str | None, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.directory = directory
        self.lock_timeout_s = lock_timeout_s
        self._memory_epoch = 0

    @property
    def path(self) -> str | None:
        return None if self.directory is None else os.path.join(self.directory, EPOCH_FILE)

    def read(self) -> int:
        """The current epoch (0 when none was ever written). Raises ConfigError for a file that is
        not an epoch file, naming it: guessing an epoch could serve KV from before a reset."""
        return self.read_state()[0]

    def read_state(self) -> tuple[int, bool]:
        """(current epoch, whether a cache reset created it); (0, False) when none was written.
        Raises ConfigError as :meth:`read`."""
        if self.directory is None:
            return self._memory_epoch, self._memory_epoch > 0
        assert self.path is not None
        if os.path.lexists(self.directory):
            self._check_directory()
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return 0, False
        except OSError as e:
            raise ConfigError(f"ssd.path: cannot read the cache epoch file {self.path}: {e.strerror}") from None
        try:
            state = json.loads(raw)
            epoch = state["epoch"]
            # Before the flag existed only a reset wrote this file.
            from_reset = state.get("reset", epoch > 0)
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0 or not isinstance(from_reset, bool):
                raise ValueError(epoch)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(
                f"ssd.path: {self.path} is not a cache epoch file ({raw[:64]!r}); remove it together "
                "with the store's objects (they may predate a cache reset)") from None
        return epoch, from_reset

    def advance(self, current: int) -> int:
        """A cache reset: move to an epoch newer than ``current`` and than any epoch this directory
        ever had, marked as created by a reset; persist it (durably) before returning it. Blocking
        (a few fsyncs)."""
        if self.directory is None:
            self._memory_epoch = max(self._memory_epoch, current) + 1
            return self._memory_epoch
        with self._locked():
            new = max(self.read(), current) + 1
            self._write(new, from_reset=True)
            return new

    def start(self) -> int:
        """The epoch an engine that is starting keys under: the current one, unless a reset created
        it (its KV may come from weights changed in memory, not the ones this engine loaded); then
        a fresh epoch, persisted before returning, and the caller removes the old one's objects.
        Call once per engine start, before any key is used. Blocking (a few fsyncs at most)."""
        if self.directory is None:
            return self._memory_epoch  # a new process: 0, nothing stored survives anyway
        epoch, from_reset = self.read_state()
        if not from_reset:
            if self._partials():
                self._remove_partials_if_unlocked()
            return epoch
        with self._locked():
            epoch, from_reset = self.read_state()  # another starter may have moved on meanwhile
            if from_reset:
                epoch += 1
                self._write(epoch, from_reset=False)
                logger.info("cache epoch %d follows a cache reset: starting at a fresh epoch %d",
                            epoch - 1, epoch)
            return epoch

    def _check_directory(self) -> None:
        """Make the directory (0700) or refuse one another user could write the epoch into
        (:func:`store_backend.private.ensure_private_dir`: NotPrivateError naming its path, owner,
        mode and the fix). In node mode it is the service's SSD directory: a client running as
        root accepts the service user's (it trusts that service already)."""
        assert self.directory is not None
        ensure_private_dir(self.directory, "ssd.path", root_trusts_owner=True)

    def _partials(self) -> list[str]:
        assert self.path is not None
        return glob.glob(glob.escape(self.path) + ".*" + PARTIAL_SUFFIX)

    def _remove_partials_if_unlocked(self) -> None:
        """Best-effort cleanup for a start that needs no lock: remove crash leftovers only if the
        lock is free right now (one try, no wait). A holder may be writing its own partial (a
        reset in progress); then they stay for a later start, and this start never waits or fails."""
        assert self.directory is not None
        try:
            lock_fd = open_private(os.path.join(self.directory, LOCK_FILE), os.O_RDWR | os.O_CREAT)
        except OSError as e:
            logger.debug("cache epoch: left partial files in %s (lock file: %s)", self.directory, e.strerror)
            return
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # BlockingIOError: held by a writer
                logger.debug("cache epoch lock in %s is held; partial files left for a later start",
                             self.directory)
                return
            try:
                self._remove_partials()
            except OSError as e:
                logger.warning("cache epoch: could not remove partial files in %s: %s", self.directory, e)
        finally:
            os.close(lock_fd)  # releases the flock

    def _remove_partials(self) -> None:
        """Remove temporary files of writes a crash cut short (lock held: no write is running)."""
        for p in self._partials():
            try:
                os.unlink(p)
                logger.info("removed %s, left by an epoch write that did not finish", p)
            except FileNotFoundError:
                pass

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.directory is not None
        self._check_directory()
        lock_path = os.path.join(self.directory, LOCK_FILE)
        lock_fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holders = ", ".join(f"pid {p}" for p in lock_holders(lock_fd)) or "another process"
                        raise ConfigError(
                            f"ssd.path: the cache epoch lock {lock_path} is held by {holders} for more "
                            f"than {self.lock_timeout_s:g} s; that process is hung or stopped (end it), "
                            "or it still runs a cache reset (try again)") from None
                    time.sleep(0.02)
            self._remove_partials()
            yield
        finally:
            os.close(lock_fd)  # releases the flock

    def _write(self, epoch: int, *, from_reset: bool) -> None:
        assert self.directory is not None and self.path is not None
        tmp = f"{self.path}.{os.getpid()}.partial"
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, json.dumps({"epoch": epoch, "reset": from_reset}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class EpochSweeper:
    """Removes, in the background, every object whose key starts with one of the given fingerprint
    digests (``"<digest>/..."``): the keys of epochs that are over.

    One owned thread, started by the first :meth:`sweep`, stopped by :meth:`close`. Requests that
    arrive while a sweep runs are merged into the next one. An object a reader holds right now
    (BUSY) is left for the store's eviction: nothing looks for old-epoch keys any more.

    Old-epoch objects may still land after a sweep listed the store (a save or offload in flight
    then; ``settle`` waits for the saves it knows of first). They are unreachable (no key of the
    current epoch has their digest) and would only take room, so each sweep lists the store a
    second time after its removals and removes what landed meanwhile, and the sweeper remembers
    the digests it retired (the last 64) and sweeps them again with every later request."""

    def __init__(self, store: KVStore, *, settle: Callable[[], object] | None = None,
                 batch_keys: int = 256, on_error: Callable[[], None] | None = None) -> None:
        """``on_error`` is called (sweeper thread) for each sweep an exception ended (logged), not
        for one ended after :meth:`close` began (the owner closing the store under it); an
        exception it raises is logged and the sweeper goes on."""
        self._store = store
        self._settle = settle  # waits for saves still in flight (their keys may be old-epoch ones)
        self._batch_keys = batch_keys
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._retired: dict[str, None] = {}  # digests swept before, oldest first
        self._stop = False
        self._workers = Workers("epoch sweeper")
        self._started = False  # its one thread was started
        self._running = False
        self.removed = 0
        self.busy = 0
        self.sweeps = 0
        self.errors = 0  # sweeps ended by an exception (logged with their tracebacks)
        self._on_error = on_error

    def sweep(self, digests: Iterable[str]) -> None:
        """Queue removal of every key under ``digests`` (non-blocking; thread-safe)."""
        with self._cond:
            if self._stop:
                return
            self._pending.update(digests)
            self._pending.update(self._retired)
            if not self._started:
                self._started = True
                self._workers.start(self._run, name="kv-epoch-sweep")
            self._cond.notify()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no sweep is queued or running (for tests and shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._running, timeout_s)

    def close(self, timeout_s: float = 5.0) -> int:
        """Let queued sweeps finish, then stop the thread (a sweep still running stops at its next
        batch; the next start sweeps again). Blocking, bounded by ``timeout_s`` as a whole. Returns
        1 when the thread was still running then (a store call that hangs): logged at WARNING by
        name and left behind; the owner counts it in ``thread_join_timeouts``."""
        deadline = Deadline(timeout_s)
        self.wait_idle(deadline.left())
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        return self._workers.join(deadline)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stop)
                if self._stop:
                    return
                digests, self._pending = self._pending, set()
                self._running = True
            try:
                self._sweep_once(digests)
            except Exception:
                with self._cond:
                    stopped = self._stop
                if stopped:
                    # close() left this sweep behind and the owner went on to close the store: the
                    # failure is the shutdown's (StoreClosedError), not a worker error; the next
                    # start sweeps these epochs again.
                    logger.info("removing the keys of %d old cache epochs stopped at close", len(digests),
                                exc_info=logger.isEnabledFor(logging.DEBUG))
                else:
                    self.errors += 1
                    logger.exception("removing the keys of %d old cache epochs failed", len(digests))
                    self._report_error()
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def _report_error(self) -> None:
        """Tell the owner; a callback that raises is logged and never ends the sweeper thread."""
        if self._on_error is None:
            return
        try:
            self._on_error()
        except Exception:
            logger.exception("epoch sweeper: error callback failed")

    def _sweep_once(self, digests: set[str]) -> None:
        with self._cond:
            for d in digests:
                self._retired.pop(d, None)
                self._retired[d] = None
            while len(self._retired) > _RETIRED_MAX:
                self._retired.pop(next(iter(self._retired)))
        if self._settle is not None:
            self._settle()
        busy_before = self.busy
        found = 0
        done: set[str] = set()  # removed, or BUSY (left to eviction): not asked again in this sweep
        for _listing in range(2):  # the second one catches objects that landed during the first pass
            victims = [k for k in self._store.keys() if k.partition("/")[0] in digests and k not in done]
            found += len(victims)
            for i in range(0, len(victims), self._batch_keys):
                with self._cond:
                    if self._stop:
                        return
                batch = victims[i:i + self._batch_keys]
                for st in self._store.remove(batch):
                    if st is Status.OK:
                        self.removed += 1
                    elif st is Status.BUSY:
                        self.busy += 1
                done.update(batch)
        self.sweeps += 1
        if found:
            logger.info("removed %d objects of old cache epochs (%d busy, left to eviction)",
                        found - (self.busy - busy_before), self.busy - busy_before)
