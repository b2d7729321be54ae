"""Bounded stopping of owned background threads: join under one deadline, report what stayed.

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

import inspect
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

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
