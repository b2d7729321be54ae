"""Owned background workers that move bytes between tiers (offload to SSD, promotion to DRAM).

A :class:`BatchWorker` is one thread draining one bounded queue in batches. The store creates its
workers, starts them in ``start()`` and stops them in ``close()``; nothing starts at import or in a
constructor. ``submit`` never blocks: a full queue refuses the item and the caller counts it.
Handler exceptions are logged and counted, and the worker keeps going.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BatchWorker(Generic[T]):
    def __init__(
        self,
        name: str,
        handle: Callable[[list[T]], None],
        *,
        queue_max: int,
        batch_max: int = 64,
        batch_weight: Callable[[T], int] | None = None,
        batch_weight_max: int = 0,
        idle_hook: Callable[[], None] | None = None,
        idle_interval_s: float = 0.05,
    ) -> None:
        self.name = name
        self._handle = handle
        self._queue: deque[T] = deque()
        self._queue_max = queue_max
        self._batch_max = batch_max
        self._weight = batch_weight
        self._weight_max = batch_weight_max
        self._idle_hook = idle_hook
        self._idle_interval_s = idle_interval_s
        self._cond = threading.Condition()
        self._in_flight = 0
        self._hook_pending = False  # kick() asked for an idle pass that has not started yet
        self._submitted = 0  # items ever queued; with _handled, lets a caller wait for a prefix
        self._handled = 0  # items taken off the queue and handled (or dropped at close)
        self._passes_started = 0  # idle-hook passes
        self._passes_done = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def submit(self, items: Iterable[T]) -> int:
        """Queue items; returns how many did not fit (they are dropped). Never blocks."""
        refused = 0
        with self._cond:
            for item in items:
                if len(self._queue) >= self._queue_max or self._stopping:
                    refused += 1
                else:
                    self._queue.append(item)
                    self._submitted += 1
            self._cond.notify()
        return refused

    def kick(self) -> int:
        """Ask for an idle-hook pass now (e.g. a watermark was crossed); wait_idle waits for it.
        Returns a pass number for :meth:`wait_for`: a pass that starts after this call."""
        with self._cond:
            if self._idle_hook is not None and self._thread is not None:
                self._hook_pending = True
            self._cond.notify()
            return self._passes_started + 1

    def mark(self) -> int:
        """A number for :meth:`wait_for`: every item submitted before this call."""
        with self._cond:
            return self._submitted

    def wait_for(self, items: int = 0, passes: int = 0, timeout_s: float | None = None) -> bool:
        """Block until the first ``items`` items ever submitted are handled and ``passes`` idle-hook
        passes are done (numbers from :meth:`mark` and :meth:`kick`), so work submitted after
        them is never waited for; returns at once when the thread is not running or is stopping.
        False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._handled < items or self._passes_done < passes) \
                    and self._thread is not None and not self._stopping:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1) if remaining is not None else 0.1)
        return True

    @property
    def stopping(self) -> bool:
        """close() has begun: a handler waiting for something may give up."""
        return self._stopping

    @property
    def depth(self) -> int:
        return len(self._queue) + self._in_flight

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is empty and no batch is in flight; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight or self._hook_pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.1)
        return True

    def close(self, drain: bool = True, timeout_s: float = 60.0) -> None:
        """Stop the thread; with ``drain``, queued items are handled first (bounded by timeout)."""
        if drain and self._thread is not None:
            self.wait_idle(timeout_s)
        with self._cond:
            self._stopping = True
            self._hook_pending = False
            self._handled += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _take_batch(self) -> list[T]:
        batch: list[T] = []
        weight = 0
        while self._queue and len(batch) < self._batch_max:
            item = self._queue[0]
            w = self._weight(item) if self._weight else 0
            if batch and self._weight_max and weight + w > self._weight_max:
                break
            batch.append(self._queue.popleft())
            weight += w
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping and not self._hook_pending:
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                    if self._idle_hook and not self._queue:
                        break
                if self._stopping:
                    return
                batch = self._take_batch()
                self._in_flight = max(1, len(batch))
                if not batch and self._idle_hook is not None:
                    # Cleared as the pass starts, so a kick() during it asks for one more.
                    self._hook_pending = False
                    self._passes_started += 1
            try:
                if batch:
                    self._handle(batch)
                elif self._idle_hook is not None:
                    self._idle_hook()
            except Exception:  # a worker must survive a bad batch; the store counts failures
                self.errors += 1
                logger.exception("%s: batch of %d failed", self.name, len(batch))
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._handled += len(batch)
                    if not batch and self._idle_hook is not None:
                        self._passes_done += 1
                    self._cond.notify_all()
