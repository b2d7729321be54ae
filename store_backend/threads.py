"""Owned background threads: started by one :class:`Workers` owner, stopped under one deadline,
with what stayed reported.

Every owner of background threads (the store's offload and promotion workers, the connectors' I/O
pools, the lookup service, the epoch sweeper) stops them in its ``close()`` with one overall
deadline: each join gets only what is left of it, so a close with several threads takes at most
its timeout, not one timeout per thread. A thread still running at the deadline is logged at
WARNING with its name and how long it was waited for, and the caller counts it
(``StoreCounters.thread_join_timeouts``); it is left behind (Python cannot stop a thread), never
silently forgotten.

Pure helpers, callable from any thread; they block at most until the deadline.
"""

from __future__ import annotations

import abc
import collections
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

logger = logging.getLogger(__name__)

# Each join waits at least this long, even past the deadline: a thread that was just told to stop
# needs a moment to wake up and return, and must not be reported as stuck for that.
JOIN_GRACE_S = 0.05


class Deadline:
    """One bound for a whole close: ``left()`` is what remains of it (never below 0)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.start = time.monotonic()
        self.at = None if timeout_s is None else self.start + max(0.0, timeout_s)

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def waited_s(self) -> float:
        return time.monotonic() - self.start


def join_threads(threads: Iterable[threading.Thread | None], deadline: Deadline, *, owner: str) -> int:
    """Join each thread with what is left of ``deadline`` (at least :data:`JOIN_GRACE_S`); returns
    how many are still running. Tell every thread to stop before calling this.

    Each one still running is logged (WARNING) with its name, ``owner`` and the seconds waited."""
    stuck = 0
    for t in threads:
        if t is None or t is threading.current_thread():
            continue
        left = deadline.left()
        t.join(None if left is None else max(left, JOIN_GRACE_S))
        if t.is_alive():
            stuck += 1
            logger.warning("%s: thread %s did not stop within %.2f s of close(); left running",
                           owner, t.name, deadline.waited_s())
    return stuck


def shutdown_pool(pool: ThreadPoolExecutor | None, deadline: Deadline, *, owner: str) -> int:
    """Stop ``pool`` (work already submitted still runs) and join its threads with what is left of
    ``deadline``; returns how many threads are still running (each logged as by :func:`join_threads`)."""
    if pool is None:
        return 0
    pool.shutdown(wait=False)
    # The executor keeps its threads in ``_threads`` (CPython 3.8+); shutdown(wait=True) would join
    # them with no bound at all.
    return join_threads(list(getattr(pool, "_threads", ())), deadline, owner=owner)


def close_within(resource: object, timeout_s: float | None) -> int:
    """Close ``resource`` (an SSD backend, an I/O engine), waiting at most ``timeout_s`` for its
    own threads where its ``close`` takes that bound (``close(timeout_s=...)``, returning how many
    threads it left running); a ``close()`` without one is called as it is (0 left running)."""
    close = resource.close  # type: ignore[attr-defined]
    try:
        bounded = "timeout_s" in inspect.signature(close).parameters
    except (TypeError, ValueError):
        bounded = False
    if not bounded:
        close()
        return 0
    return int(close(timeout_s=timeout_s) or 0)


class Workers:
    """The background threads of one owner (a replicator, a sweeper, a residency bus ...): each
    started by :meth:`start`, named and a daemon; an exception that escapes one is logged with its
    traceback, counted (:attr:`errors`) and passed on to ``on_error`` (the owner's own counter),
    never lost with the thread; :meth:`join` joins them all under one deadline and returns how
    many are still running (each logged by :func:`join_threads`). Threads that ended are forgotten
    at the next start or join. Thread-safe."""

    def __init__(self, owner: str, *, on_error: Callable[[], None] | None = None) -> None:
        self.owner = owner
        self._on_error = on_error
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._errors = 0

    @property
    def errors(self) -> int:
        """Exceptions that escaped a thread of this owner (each logged with its traceback)."""
        return self._errors

    def alive(self) -> list[threading.Thread]:
        """The threads still running."""
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return list(self._threads)

    def start(self, target: Callable[..., object], *args: object, name: str) -> threading.Thread:
        """Start ``target(*args)`` on a daemon thread called ``name``; returns the thread."""
        def run() -> None:
            try:
                target(*args)
            except BaseException:  # noqa: BLE001  (logged and counted: the thread ends either way)
                with self._lock:
                    self._errors += 1
                logger.exception("%s: thread %s ended with an exception", self.owner, name)
                if self._on_error is not None:
                    self._on_error()

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()
        return t

    def join(self, deadline: Deadline) -> int:
        """Join every thread (tell them to stop first) with what is left of ``deadline``; returns
        how many are still running. The calling thread, if it is one of them, is not waited for."""
        with self._lock:
            threads = list(self._threads)
        stuck = join_threads(threads, deadline, owner=self.owner)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
        return stuck


_Q = TypeVar("_Q", bound="QueueThread")


class QueueThread(abc.ABC):
    """Base of a component that owns one thread draining a queue of its own (``self._queue``, a
    deque) under ``self._cond``: :meth:`start` starts ``self._run`` as ``thread_name``;
    :meth:`close` sets ``self._stopping``, drops what is queued, wakes the thread and joins it
    (within ``timeout_s``; one still running is logged by :class:`Workers`)."""

    def __init__(self, owner: str, thread_name: str) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._stopping = False
        self._workers = Workers(owner)
        self._thread_name = thread_name

    def start(self: _Q) -> _Q:
        self._workers.start(self._run, name=self._thread_name)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        self._workers.join(Deadline(timeout_s))

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread: drain ``self._queue`` until ``self._stopping``."""
