"""The POSIX fallback engine: :class:`PosixEngine`, preadv/pwritev on a bounded thread pool.

Who calls it: the SSD backends and :mod:`mooncake_kv.bench.raw_direct` through the
:class:`~.base.IoEngine` Protocol (any thread), built by :func:`~.factory.make_io_engine` where
io_uring is refused or not wanted; :class:`~.uring_engine.IoUringEngine` borrows ``sync_inline``
for a thread without a ring. Thread-safe: a batch runs on the engine's own pool (started on first
use), each pool thread with its own staging area.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor, as_completed

from store_backend.ssd.io.base import Completion
from store_backend.ssd.io.planning import (
    DEFAULT_STAGING_BYTES,
    Bounce,
    Staging,
    execute_sync,
)
from store_backend.ssd.io.requests import IoRequest
from store_backend.threads import Deadline

logger = logging.getLogger(__name__)

# How long close() waits for the pool's threads (they only run inside a caller's batch).
CLOSE_TIMEOUT_S = 10.0


class PosixEngine:
    """preadv/pwritev on a bounded pool of ``threads`` workers (started on first use)."""

    name = "posix"

    def __init__(self, threads: int = 2, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.threads = max(1, threads)
        self.staging_bytes = staging_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stagings: list[Staging] = []
        self._closed = False
        # Pool threads inside a request now (by name), so close() waits only for real I/O: idle
        # threads just exit once the pool is shut down. Notified on _idle as each one finishes.
        self._busy: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self._released = False  # close() released the stagings: a request still queued is refused

    def _alloc(self, nbytes: int) -> Bounce | None:
        st = getattr(self._local, "staging", None)
        if st is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("io engine is closed")
                st = Staging(self.staging_bytes)
                self._stagings.append(st)
            self._local.staging = st
        return st.alloc(nbytes)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("io engine is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-posix-io")
            return self._pool

    def read(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, False, on_complete)

    def write(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, True, on_complete)

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("io engine is closed")

    def _run(self, requests: Sequence[IoRequest], write: bool, on_complete: Completion | None) -> list[int]:
        results = [0] * len(requests)
        if len(requests) == 1 or self.threads == 1:
            # Inline in the caller's thread: its staging area may be one close() released already.
            self._check_open()
            for i, req in enumerate(requests):
                results[i] = execute_sync(req, write, self._alloc)
                if on_complete is not None:
                    on_complete(i, results[i])
            return results
        pool = self._executor()
        futures = {pool.submit(self._in_pool, execute_sync, req, write, self._alloc): i
                   for i, req in enumerate(requests)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_complete is not None:
                on_complete(i, results[i])
        return results

    def _in_pool(self, fn: Callable[..., int], *args: Any) -> int:
        """A pool thread runs one request, marked busy meanwhile (see close())."""
        name = threading.current_thread().name
        with self._lock:
            if self._released:
                raise RuntimeError("io engine is closed")
            self._busy.add(name)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy.discard(name)
                self._idle.notify_all()

    @staticmethod
    def _sync_one(fd: int, datasync: bool) -> int:
        try:
            (os.fdatasync if datasync else os.fsync)(fd)
            return 0
        except OSError as e:
            return -(e.errno or errno.EIO)

    @staticmethod
    def sync_inline(fds: Sequence[int], datasync: bool = True) -> list[int]:
        """fdatasync/fsync each fd in the calling thread; 0 or -errno per fd."""
        return [PosixEngine._sync_one(fd, datasync) for fd in fds]

    def sync(self, fds: Sequence[int], *, datasync: bool = True) -> list[int]:
        if len(fds) <= 1 or self.threads == 1:
            return self.sync_inline(fds, datasync)
        return list(self._executor().map(lambda fd: self._in_pool(self._sync_one, fd, datasync), fds))

    def close(self, timeout_s: float | None = None) -> int:
        """Stop the pool: blocking, at most ``timeout_s`` (default ``CLOSE_TIMEOUT_S``; a store's
        close passes what is left of its own deadline) for pool threads still inside a request;
        idle ones are not waited for (they exit by themselves). Returns how many were still in a
        request then (a hung disk): each is logged at WARNING by name and left behind, and the
        staging areas are left to them (their bounce buffers live there, and requests already
        queued behind them still run). Later calls raise RuntimeError("io engine is closed").
        Idempotent (a second close returns 0)."""
        deadline = Deadline(CLOSE_TIMEOUT_S if timeout_s is None else timeout_s)
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # wait=True would wait for a hung read with no bound at all
        with self._lock:
            while self._busy:
                left = deadline.left()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            stuck = sorted(self._busy)
            stagings: list[Staging] = []
            if not stuck:
                self._released = True
                stagings, self._stagings = self._stagings, []
        for name in stuck:
            logger.warning("posix io engine: thread %s did not stop within %.2f s of close() (still in a "
                           "request); left running with its staging area", name, deadline.waited_s())
        for st in stagings:
            st.close()
        return len(stuck)
