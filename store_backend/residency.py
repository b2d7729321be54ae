"""Residency events: where the store's objects are, as it changes (stored, moved, evicted, removed).

The store publishes an event for every change of an object's residency, under its own lock, on
its :class:`ResidencyBus`; the bus hands them to subscribers (a node service waking ``exists``
waiters, a directory of which node holds what, KV events for an engine) on its own thread, in
order, with no store lock held. Subscribers learn; they never decide: the store's own reaction to
an eviction inside a lower tier is synchronous (``TieredStore._on_below_evicted``), because
correctness depends on it.

Kinds (``tier`` names the tier the event is about):

- ``stored``: a put (or a slot commit) made the object visible, in ``tier`` "dram";
- ``moved``: a copy landed in ``tier`` from ``src_tier`` (an offload "dram" -> "ssd", a promotion
  "ssd" -> "dram"); the source copy may stay (an offload keeps DRAM's);
- ``evicted``: ``tier`` dropped its copy for room (DRAM's eviction, a watermark demotion, an SSD
  backend's own eviction); ``lost`` when it was the last copy the store had;
- ``removed``: ``remove()`` deleted the object from every tier (``tier`` is ``"*"``).

Bounded: at most ``queue_max`` events wait for delivery. Past that, events are dropped and
counted (``dropped``), and every subscriber's ``on_gap`` is called once, after the events queued
before the drop, so it can resync from the store's ``keys()``. ``publish`` never blocks on a
subscriber: it takes the bus's own short lock to append.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

QUEUE_MAX = 1 << 16

EventKind = Literal["stored", "moved", "evicted", "removed"]

# ``tier`` of a ``removed`` event: the object is gone from every tier.
ALL_TIERS = "*"


class ResidencyEvent(msgspec.Struct, frozen=True, array_like=True):
    kind: EventKind
    key: str
    tier: str  # moved: the destination
    size: int  # bytes of the object (0 when the store no longer knows it, e.g. a removed SSD-only object)
    src_tier: str | None = None  # moved only
    lost: bool = False  # evicted: it was the last copy the store had
    seq: int = 0  # store-wide, increasing, stamped by the bus at publish
    # Wall-clock seconds (time.time()) stamped by the bus at publish; publish runs under the store
    # lock at the change, so for ``stored`` it is the commit time (the pool's remove rule uses it).
    at_s: float = 0.0


Subscriber = Callable[[list[ResidencyEvent]], None]


class ResidencyBus:
    """One bounded queue and one owned delivery thread ("kv-events"): ``start()``/``close()``.

    Thread-safe. ``publish`` may be called with any lock held (it is O(events), never waits for a
    subscriber); subscribers are called on the bus thread, one batch at a time, in ``seq`` order,
    with no lock of the bus (or the store) held. An exception from a subscriber is logged and
    counted in ``subscriber_errors``; delivery goes on. Without subscribers events are numbered and
    dropped at once (nothing is queued, nothing counted as dropped).
    """

    def __init__(self, *, queue_max: int = QUEUE_MAX, batch_max: int = 1024, name: str = "kv-events") -> None:
        self.name = name
        self._queue: deque[ResidencyEvent] = deque()
        self._queue_max = queue_max
        self._batch_max = batch_max
        self._cond = threading.Condition()
        self._subs: dict[int, tuple[Subscriber, Callable[[], None]]] = {}
        self._ids = itertools.count(1)
        self._seq = 0
        self._gap = False  # events were dropped: on_gap is owed after what is queued
        self._in_flight = 0
        self._stopping = False
        self._workers = Workers(name)
        self._running = False  # the delivery thread was started and not yet told to close
        self.dropped = 0
        self.subscriber_errors = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the delivery thread (idempotent)."""
        with self._cond:
            if self._running or self._stopping:
                return
            self._running = True
            self._workers.start(self._run, name=self.name)

    def stop(self) -> None:
        """Refuse new events; the thread delivers what is queued, then ends (non-blocking: an
        owner stopping several threads tells them all before joining any)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def close(self, deadline: Deadline | None = None) -> bool:
        """:meth:`stop`, then wait (until ``deadline``) for the thread to deliver what is queued
        and end. Returns False when it was still running at the deadline (a stuck subscriber;
        logged by :func:`join_threads` and left behind). Idempotent."""
        deadline = deadline if deadline is not None else Deadline(10.0)
        self.stop()
        with self._cond:
            self._running = False
        return self._workers.join(deadline) == 0

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every event published so far was delivered (or dropped); False on timeout.
        Returns at once when the thread is not running."""
        deadline = Deadline(timeout_s)
        with self._cond:
            while (self._queue or self._in_flight or self._gap) and self._running:
                left = deadline.left()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(left, 0.1))
        return True

    # -- publishing and subscribing ----------------------------------------------------------------
    def subscribe(self, fn: Subscriber, on_gap: Callable[[], None] | None = None) -> Callable[[], None]:
        """Deliver every event published from now on to ``fn`` (batches, in order); ``on_gap`` when
        some were dropped. Returns the call that unsubscribes."""
        with self._cond:
            sid = next(self._ids)
            self._subs[sid] = (fn, on_gap or (lambda: None))

        def unsubscribe() -> None:
            with self._cond:
                self._subs.pop(sid, None)

        return unsubscribe

    def publish(self, events: Sequence[ResidencyEvent]) -> None:
        """Number ``events`` and queue them for delivery; never blocks on a subscriber."""
        if not events:
            return
        with self._cond:
            if not self._subs or self._stopping:
                self._seq += len(events)
                return
            room = self._queue_max - len(self._queue)
            now_s = time.time()
            for e in events[:max(0, room)]:
                self._seq += 1
                self._queue.append(msgspec.structs.replace(e, seq=self._seq, at_s=e.at_s or now_s))
            over = len(events) - max(0, room)
            if over > 0:
                self._seq += over
                self.dropped += over
                self._gap = True
            self._cond.notify()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def published_seq(self) -> int:
        """The ``seq`` of the last event published (dropped ones counted): a subscriber that has
        seen an event with this ``seq`` has seen every change made so far. Thread-safe."""
        with self._cond:
            return self._seq

    # -- the delivery thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._gap and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queue and not self._gap:
                    return
                n = min(len(self._queue), self._batch_max)
                batch = [self._queue.popleft() for _ in range(n)]
                gap = self._gap and not self._queue  # owed after the events queued before the drop
                if gap:
                    self._gap = False
                subs = list(self._subs.values())
                self._in_flight = 1
            try:
                for fn, on_gap in subs:
                    for call in ((lambda f=fn: f(batch)) if batch else None, on_gap if gap else None):
                        if call is None:
                            continue
                        try:
                            call()
                        except Exception:
                            logger.exception("%s: a residency subscriber failed", self.name)
                            with self._cond:
                                self.subscriber_errors += 1
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()
