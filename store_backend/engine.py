"""Owned background workers that move bytes between tiers (offload to SSD, promotion to DRAM).

A :class:`BatchWorker` is one thread (or a few, ``threads``, so that one batch's I/O overlaps the
next one's) draining one bounded FIFO queue in batches. The store creates its workers, starts them
in ``start()`` and stops them in ``close()``; nothing starts at import or in a constructor.
``submit`` never blocks: a full queue refuses the item and the caller counts it.

Errors are reported, never lost: an exception that escapes the handler (or the idle hook) is
logged with its traceback, counted in ``errors`` and passed to ``on_error``, and the worker keeps
going. Should the loop itself die (its own bookkeeping raised), that is logged and counted the same
way, the worker is marked ``dead``, ``submit`` refuses everything from then on and every waiter
returns at once, so callers (a store's flush) go on without it instead of hanging. ``close()`` is
bounded by its timeout as a whole and says whether the thread stopped; one that did not is logged
at WARNING with its name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from store_backend.threads import Deadline, Workers

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
        on_error: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        threads: int = 1,
    ) -> None:
        """``on_error`` is called (from a worker thread, holding no lock of the worker's) once per
        exception that escaped the handler, the idle hook or the loop. ``on_exit`` is called by
        each worker thread as its last step (once the last one ends, ``running`` is False), however
        the loop ended: an owner that left a thread behind at close releases what it kept for it.
        ``threads``: how many threads take batches off the queue at once (each one batch at a
        time, all named ``name``; the handler must be thread-safe); the idle hook runs on one of
        them at a time."""
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
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
        self._in_flight = 0  # items (an idle pass counts one) the threads are handling now
        self._nthreads = threads
        self._hook_running = False  # a thread is in the idle hook (one at a time)
        self._hook_pending = False  # kick() asked for an idle pass that has not started yet
        self._submitted = 0  # items ever queued; with _handled, lets a caller wait for a prefix
        self._handled = 0  # items taken off the queue and handled (or dropped at close)
        self._passes_started = 0  # idle-hook passes
        self._passes_done = 0
        self._stopping = False
        self._workers = Workers(name)
        self._threads: list[threading.Thread] = []
        self._on_error = on_error
        self._dead = False  # a loop died of an exception; nothing is handled any more
        self._on_exit = on_exit
        self._running = 0  # threads started whose loop has not ended yet
        self.errors = 0

    def start(self) -> None:
        if self._threads:
            return
        with self._cond:  # a new thread's loop waits for this lock: it sees the whole list and count
            self._running = self._nthreads
            self._threads = [self._workers.start(self._run, name=self.name) for _ in range(self._nthreads)]

    def submit(self, items: Iterable[T], *, front: bool = False) -> int:
        """Queue items (FIFO: handled in the order submitted); returns how many did not fit (the
        last ones; they are dropped). Never blocks. ``front``: ahead of everything queued, in
        their order (work taken off the queue and handed back, which came before what is queued;
        :meth:`wait_for` counts them as submitted now)."""
        refused = 0
        taken: list[T] = []
        with self._cond:
            for item in items:
                if len(self._queue) + len(taken) >= self._queue_max or self._stopping or self._dead:
                    refused += 1
                else:
                    taken.append(item)
                    self._submitted += 1
            if front:
                self._queue.extendleft(reversed(taken))
            else:
                self._queue.extend(taken)
            self._cond.notify()
        return refused

    def kick(self) -> int:
        """Ask for an idle-hook pass now (e.g. a watermark was crossed); wait_idle waits for it.
        Returns a pass number for :meth:`wait_for`: a pass that starts after this call."""
        with self._cond:
            if self._idle_hook is not None and self._threads:
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
        them is never waited for; returns at once when the thread is not running, is stopping or
        died. False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._handled < items or self._passes_done < passes) \
                    and self._threads and not self._stopping and not self._dead:
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
    def dead(self) -> bool:
        """The loop died of an exception (logged and counted): nothing is handled any more."""
        return self._dead

    @property
    def depth(self) -> int:
        return len(self._queue) + self._in_flight

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is empty and no batch is in flight; False on timeout, or at once
        when the loop died with work left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight or self._hook_pending:
                if self._dead:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.1)
        return True

    def stop(self) -> None:
        """Ask the thread to stop after its current batch and drop what is queued (non-blocking);
        an owner with several workers stops them all before joining any (see :meth:`close`)."""
        with self._cond:
            self._stopping = True
            self._hook_pending = False
            self._handled += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()

    def close(self, drain: bool = True, timeout_s: float = 60.0, *, deadline: Deadline | None = None) -> bool:
        """Stop the thread; with ``drain``, queued items are handled first. Blocking, bounded by
        ``timeout_s`` (or by the caller's ``deadline``, shared with its other joins) as a whole.
        Returns False when the thread was still running at the deadline (logged at WARNING with
        its name; it is left behind, and stops after its current batch)."""
        if deadline is None:
            deadline = Deadline(timeout_s)
        if drain and self._threads:
            self.wait_idle(deadline.left())
        self.stop()
        self._threads = []
        return self._workers.join(deadline) == 0

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

    def _error(self) -> None:
        self.errors += 1
        if self._on_error is not None:
            try:
                self._on_error()
            except Exception:
                logger.exception("%s: error callback failed", self.name)

    @property
    def running(self) -> bool:
        """Started, and a loop has not ended yet (it may still be in a batch after close())."""
        return self._running > 0

    @property
    def busy(self) -> bool:
        """A thread is inside a batch or an idle-hook pass now. After :meth:`stop`, a worker that
        is not busy never calls its handler again, even while its threads are still winding down."""
        with self._cond:
            return self._running > 0 and self._in_flight > 0

    def _run(self) -> None:
        try:
            self._run_loop()
        finally:
            with self._cond:
                self._running -= 1
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    logger.exception("%s: exit callback failed", self.name)

    def _run_loop(self) -> None:
        try:
            self._loop()
        except BaseException:
            # The loop's own bookkeeping raised (a handler's exception never gets here): mark the
            # worker dead so that waiters and submitters go on without it, and say so loudly.
            logger.exception("%s: worker loop died; its work is no longer done in the background", self.name)
            with self._cond:
                self._dead = True
                self._in_flight = 0
                self._hook_pending = False
                self._cond.notify_all()
            self._error()

    def _loop(self) -> None:
        while True:
            hook = False
            with self._cond:
                while not self._queue and not self._stopping and not self._dead \
                        and not (self._hook_pending and not self._hook_running):
                    self._cond.wait(self._idle_interval_s if self._idle_hook else None)
                    if self._idle_hook and not self._queue and not self._hook_running:
                        break
                if self._stopping or self._dead:
                    return
                batch = self._take_batch()
                if self._queue:
                    self._cond.notify()  # more for another thread (submit woke only this one)
                if not batch and self._idle_hook is not None:
                    if self._hook_running:
                        continue  # another thread is in the idle hook: wait again
                    # Cleared as the pass starts, so a kick() during it asks for one more.
                    self._hook_pending = False
                    self._hook_running = hook = True
                    self._passes_started += 1
                taken = max(1, len(batch))
                self._in_flight += taken
            try:
                if batch:
                    self._handle(batch)
                elif hook:
                    self._idle_hook()  # type: ignore[misc]
            except Exception:  # a worker must survive a bad batch; the owner counts it (on_error)
                logger.exception("%s: batch of %d failed", self.name, len(batch))
                self._error()
            finally:
                with self._cond:
                    self._in_flight = max(0, self._in_flight - taken)
                    self._handled += len(batch)
                    if hook:
                        self._hook_running = False
                        self._passes_done += 1
                    self._cond.notify_all()
