"""TieredStore: the embedded store (host DRAM over an ordered list of lower tiers) that engines call.

The DRAM arena is the store's own (bookkeeping under its lock, copies outside it); the tiers below
it (the SSD tier today, a pool later) sit behind the :class:`~store_backend.tiers.base.Tier`
Protocol and are only ever called with no store lock held. The first tier that backs DRAM (the
SSD tier) is the offload target; reads, lookups and removes go through every tier in order.

Thread-safe; every public method may be called from any thread. One lock guards the index
(DRAM entries, allocator, policy, counters); byte copies and SSD I/O run outside it, on entries
that are reserved or leased, so a slow copy never blocks other callers' bookkeeping. Background
movement (offload to SSD, promotion back to DRAM) runs on two owned :class:`BatchWorker` workers
(the offload one with ``offload.write_threads`` threads) started by ``start()`` and stopped by
``close()``; it is never on the put path. With an SSD tier, DRAM never drops an acknowledged object
before its SSD copy exists: a put that finds only such objects in its way waits for the offload to
make room (``offload.put_wait_s``, on a condition of the store lock) or answers NO_SPACE.

Buffers: ``put`` copies from the caller's buffers before it returns (the caller may reuse them at
once); ``get_into`` copies into the caller's writable buffers before it returns. No other copy of
an object is made on the way into or out of the DRAM arena.

Slots (``reserve``/``commit``/``abort``, ``lease``/``release``, ``reclaim``; tokens in
:class:`~store_backend.slots.SlotTable`): the caller copies into or out of the arena itself
between two calls, so the bytes go straight between the arena (a shared segment with
``fresh_segment``) and an engine's pages. ``put`` is the same reserve half and commit half with the
copy in between, and ``get_into``'s DRAM part the same lease bookkeeping, without tokens.

One contract for both tiers: a call answers the same whether the object sits in DRAM or on SSD
(``BUFFER_TOO_SMALL`` carries the object's size; a read-only buffer raises ``TypeError``). After
``close()`` has begun, every method but ``close()`` raises :class:`StoreClosedError`; calls
already running when it begins finish first (``close`` waits for them), so a caller never sees
an SSD backend's own "closed" error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from store_backend.api import StoreClosedError  # defined there; re-exported here
from store_backend.coherence import EvictionClock, KnownBelow, LossLedger, RemovalTracker, Ticket
from store_backend.config import StoreConfig, load_config
from store_backend.core.common import MAX_OFFLOAD_ATTEMPTS
from store_backend.core.fill import StoreFill
from store_backend.core.flush import StoreFlush
from store_backend.core.offload import StoreOffload
from store_backend.core.pins import StorePins
from store_backend.core.queries import StoreQueries
from store_backend.core.reads import StoreReads
from store_backend.core.removal import StoreRemoval
from store_backend.core.slot_calls import StoreSlots
from store_backend.core.stats import StoreStatsView
from store_backend.core.writes import StoreWrites
from store_backend.dram import Entry, EntryState, HostDramTier
from store_backend.engine import BatchWorker
from store_backend.metrics import LatencyHistogram, StoreMetrics
from store_backend.policies.admission import AdmissionPolicy, AdmitAll, make_admission
from store_backend.residency import ResidencyBus, Subscriber
from store_backend.slots import MAX_HELD_FRACTION, SlotTable
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.factory import open_ssd_backend
from store_backend.threads import JOIN_GRACE_S, Deadline, Workers, close_within
from store_backend.tiers.base import Tier
from store_backend.tiers.ssd import SsdTier
from store_backend.types import FlushReport, check_batch

__all__ = ["MAX_OFFLOAD_ATTEMPTS", "StoreClosedError", "TieredStore"]

logger = logging.getLogger(__name__)

class TieredStore(StoreWrites, StoreSlots, StoreReads, StoreFill, StoreQueries, StoreRemoval,
                  StorePins, StoreFlush, StoreOffload, StoreStatsView):
    def __init__(
        self,
        config: StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        ssd: SsdBackend | None = None,
        tiers: Sequence[Tier] = (),
        fresh_segment: bool = False,
        max_held_fraction: float = MAX_HELD_FRACTION,
        checksums: bool = False,
    ) -> None:
        """Open the tiers (an SSD directory is recovered here). ``ssd`` injects an SSD backend and
        ``tiers`` more tiers below it, in order (tests; the store owns them from here on).

        ``fresh_segment``: the DRAM arena is a new /dev/shm segment ``<dram.shm_name>-<start_ns>``
        (leftovers of owners that exited are unlinked first), never a reused one: what the node
        service passes to its clients (see :meth:`segment`). ``dram.shm_name`` must be set.
        ``max_held_fraction``: the share of the arena one slot owner may hold (see :meth:`reserve`).
        ``checksums``: keep each DRAM object's :func:`~store_backend.checksum.object_checksum`
        (taken from a slot commit, or computed where the store writes the bytes itself: put,
        stage-in, promotion, replicas) and hand it out with every lease, so a reader in another
        process can verify what it copied (the node service: its arena is shared)."""
        self.config = load_config(config)
        dram = self.config.dram
        # Tokens of reserve/lease (before anything is opened: a bad fraction opens nothing).
        self._slots = SlotTable(dram.capacity_bytes - dram.capacity_bytes % dram.alignment_bytes, max_held_fraction)
        self._checksums = checksums
        self._lock = threading.Lock()
        # The tiers below DRAM, fastest first (ssd, then a pool), each behind the Tier Protocol;
        # ``_backing`` is the first whose copy makes a DRAM copy clean: the offload target.
        self._below: list[Tier] = [*([SsdTier(ssd)] if ssd is not None else []), *tiers]
        # A failed open releases what it took (the /dev/shm segment, the SSD directory's lock and
        # injected tiers, which the store owns from here on), so a retry finds nothing held.
        try:
            self._dram = HostDramTier(self.config.dram, fresh_segment=fresh_segment)
            try:
                if ssd is None and self.config.ssd is not None:
                    self._below.insert(0, SsdTier(open_ssd_backend(self.config.ssd)))
                self._admission: AdmissionPolicy = make_admission(
                    self.config.ssd.admission_policy if self.config.ssd is not None else AdmitAll.name)
            except BaseException:
                self._dram.close()
                raise
        except BaseException:
            for t in reversed(self._below):
                t.close()
            raise
        self._backing: Tier | None = next((t for t in self._below if t.traits.backs_dram), None)
        self.metrics_counters = StoreMetrics(tuple(t.name for t in self._below))
        self._ssd_hits: dict[str, int] = {}
        self._tiers_raised: set[str] = set()  # names of tiers whose read raised (logged once each)
        self._closed = False
        self._started = False
        self._closing = False  # close() has begun: new calls are refused
        self._calls = 0  # public calls in flight; close() waits for them
        # close() gave up on threads still using the tiers (a call, a worker, its own flush): the
        # last of them to leave closes the tiers (_last_user_left); until then they stay open.
        self._tiers_owed = False
        self._changed = threading.Condition(self._lock)  # notified when a call or an SSD write ends
        # Notified when a key may have become present or stopped being written (a commit, an
        # abort, an expiry, a reclaim, a remove, a promotion or stage-in ending) and at close: what
        # exists(wait_s) and lease(wait_pending_s) wait for.
        self._slot_changed = threading.Condition(self._lock)
        # Notified when the offload may have made DRAM room (an SSD write landed, a demotion dropped
        # what it wrote) and at close: what a put waiting for room (offload.put_wait_s) waits for.
        self._room = threading.Condition(self._lock)
        self._removals = RemovalTracker()
        self._losses = LossLedger()
        self._evictions = EvictionClock()  # evictions the SSD tier reported, numbered per key
        self._known_below = KnownBelow()  # dropped from DRAM while persisted: believed on SSD
        self._bus = ResidencyBus()
        for t in self._below:
            t.set_eviction_listener(functools.partial(self._on_below_evicted, t))
        if self._backing is not None:  # what an earlier run left below counts as stored for admission
            self._known_below.seed(self._backing.keys())
        self._offloading: dict[str, Entry] = {}  # SSD writes in flight, by key
        self._writing_bytes = 0  # DRAM bytes leased by SSD writes in flight, all writers together
        self._put_seq = 0  # numbers committed puts (Entry.put_seq), so a flush knows what came before it
        self._commits = 0  # commit rounds that stored something (exists(wait_s) waits for it to move)
        self._abandoned: dict[str, float] = {}  # key -> when its reservation ended unstored (abandoned())
        # Unpins owed to no live entry, by key: pins on an entry that a remove took away, and pins
        # of an object that was only on SSD (nothing pinned). The next unpins of the key pay them
        # off, so they never release a pin someone took on the key's newer entry. (count, expiry)
        self._void_pins: dict[str, tuple[int, float]] = {}
        off = self.config.offload
        self._offloader: BatchWorker[str] = BatchWorker(
            "kv-offload",
            self._offload_batch,
            queue_max=off.queue_max_objects,
            batch_max=max(1, self.config.ssd.bucket_max_keys if self.config.ssd else 256),
            batch_weight=self._queued_size,
            # What one write may lease (at most half of DRAM), so a batch taken is a batch written.
            batch_weight_max=self._write_batch_bytes(),
            idle_hook=self._watermark_tick if off.policy == "watermark" else None,
            on_error=self._worker_error,
            on_exit=self._worker_exited,
            threads=off.write_threads,  # so that one batch's write overlaps the next one's
        )
        self._promoter: BatchWorker[str] = BatchWorker(
            "kv-promote", self._promote_batch, queue_max=self.config.promotion.queue_max_objects, batch_max=32,
            on_error=self._worker_error, on_exit=self._worker_exited,
        )

    def start(self) -> TieredStore:
        """Start the background workers (idempotent). Without start(), nothing moves between tiers."""
        self._check_open()
        if not self._started:
            self._bus.start()
        if not self._started and self._below:
            self._offloader.start()
            self._promoter.start()
        self._started = True
        return self

    def close(self, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Close the store: blocking, idempotent.

        From the moment it begins, new calls raise :class:`StoreClosedError`; calls already
        running finish first (waited for up to ``timeout_s``). With ``flush``, everything that
        ``flush()`` promises is then written to SSD, in both offload policies, before the workers
        stop (objects that could not be are logged); without it, queued offloads are dropped.
        Then the SSD tier and the arena are closed.

        All of it is bounded by ``timeout_s`` together (one deadline: the wait for calls, the flush,
        the joins of the workers and the SSD tier's own close each get what is left of it). The
        flush runs on a thread of its own ("kv-close-flush") so that a hung SSD cannot hold close
        past the deadline. Every thread still using the tiers at the deadline is logged at WARNING
        and counted in ``store.thread_join_timeouts``: a worker or the close's flush in an SSD
        write that hangs, a public call still running (``get_into``, ``remove``, ``flush`` ...),
        and the SSD engine's own I/O threads. The tiers (SSD and DRAM) are then left open for
        them, never closed under their I/O (a descriptor closed under a read lets it read whatever
        file reuses the number), and the last of them to finish closes the tiers and releases the
        SSD directory's lock, so the directory can be opened again in this process. What such a
        late write lands stays on SSD.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._slot_changed.notify_all()  # waits in exists(wait_s) and lease(wait_pending_s) end now
            self._room.notify_all()  # so do puts waiting for DRAM room (they answer NO_SPACE)
            limit = Deadline(timeout_s)
            deadline = limit.start + timeout_s
            while self._calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("close: %d calls still running after %.1f s; the tiers stay open "
                                   "until they end", self._calls, timeout_s)
                    break
                self._changed.wait(left)
        flusher = self._flush_for_close(limit) if flush and self._backing is not None else None
        workers = (self._offloader, self._promoter)
        for w in workers:
            w.stop()
        self._bus.stop()  # delivers what is queued while the workers are joined
        stuck = [w.name for w in workers if not w.close(drain=False, deadline=limit)]
        bus_stuck = 0 if self._bus.close(limit) else 1  # it never touches a tier: no reason to keep one open
        with self._lock:
            self._closed = True
            calls = self._calls  # public calls still running, and the close's flush if it hangs
            self.metrics_counters.store.thread_join_timeouts += len(stuck) + bus_stuck + calls
            # A worker merely slow to wake from stop() (counted above) no longer touches a tier.
            running = [w.name for w in workers if w.busy]
            if flusher is not None and flusher.is_alive():
                running.append(flusher.name)  # (it is one of the calls)
            self._tiers_owed = bool(calls or running)
        if calls or running:
            logger.warning("close: the tiers stay open for %d thread(s) still using them after %.2f s "
                           "(calls in flight: %d; %s); the last to finish closes them",
                           calls + len([w for w in workers if w.name in running]), limit.waited_s(), calls,
                           ", ".join(running) or "no worker")
            return
        self._close_tiers(limit.left())

    def _flush_for_close(self, limit: Deadline) -> threading.Thread:
        """close()'s flush, on a thread of its own counted as a call in flight: waited for until
        ``limit`` (and a short grace); one still writing then is left to finish (close logs and
        counts it). Returns the thread."""
        done: list[FlushReport] = []
        # The flush's own bound ends a little before close's (a tenth of it, at most 1 s), so a
        # flush that merely timed out has returned by the time it is counted as left running.
        left = limit.left()
        total_s = None if limit.at is None else limit.at - limit.start
        budget = None if left is None or total_s is None else max(0.0, left - min(1.0, 0.1 * total_s))

        def run() -> None:
            try:
                done.append(self._flush(budget))
            except Exception:
                logger.exception("close: the flush failed")
            finally:
                self._leave_call()

        with self._lock:
            self._calls += 1
        t = Workers("store close").start(run, name="kv-close-flush")  # joined here, counted by close()
        left = limit.left()
        t.join(None if left is None else max(left, JOIN_GRACE_S))
        if done and not done[0].ok:
            logger.warning("close: %s", done[0].summary())
        return t

    def _leave_call(self) -> None:
        """A call (or close's flush) ends: wake close(), and close the tiers if close() left them
        open for it and it is the last user."""
        with self._lock:
            self._calls -= 1
            if not self._calls:
                self._changed.notify_all()
            last = self._last_user_left()
        if last:
            self._close_tiers(None)

    def _worker_exited(self) -> None:
        """A worker's thread ends (on_exit, in that thread): the last user of tiers that close()
        left open closes them."""
        with self._lock:
            last = self._last_user_left()
        if last:
            self._close_tiers(None)

    def _last_user_left(self) -> bool:
        """(lock held) True, once, when close() left the tiers open and nothing uses them any more:
        the caller closes them."""
        if not self._tiers_owed or self._calls or self._offloader.busy or self._promoter.busy:
            return False
        self._tiers_owed = False
        return True

    def _close_tiers(self, timeout_s: float | None) -> None:
        """Close every tier below DRAM, fastest first (an SSD backend's engine threads waited for
        at most ``timeout_s``; those left running are counted), then the DRAM arena. No thread of
        the store uses them any more. A tier whose close fails is logged; the others still close."""
        stuck = 0
        try:
            for t in self._below:
                try:
                    # The SSD backend itself takes the bound (its SsdTier wrapper does not).
                    stuck += close_within(t.backend if isinstance(t, SsdTier) else t, timeout_s)
                except Exception:
                    logger.exception("close: closing the %s tier failed", t.name)
        finally:
            if stuck:
                with self._lock:
                    self.metrics_counters.store.thread_join_timeouts += stuck
            self._dram.close()

    def __enter__(self) -> TieredStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, fn: Subscriber, on_gap: Callable[[], None] | None = None) -> Callable[[], None]:
        """Residency events (:mod:`store_backend.residency`) from now on, delivered in order on the
        store's "kv-events" thread once ``start()`` ran, with no store lock held; ``on_gap`` when
        some were dropped (the queue was full: resync from :meth:`keys`). Returns the call that
        unsubscribes. Thread-safe."""
        return self._bus.subscribe(fn, on_gap)

    def invalidate_reads(self, keys: Sequence[str]) -> None:
        """Reads of ``keys`` in flight from a lower tier (a pool pull, a promotion) keep no local
        copy when they land, as if the keys had been removed; what is stored stays. For a remove
        that keeps a newer copy (the pool's retried remove): a pull of the older bytes that began
        before it must not be kept beside, or after, the newer one. Thread-safe, quick."""
        check_batch(keys)
        with self._call():
            with self._lock:
                for k in keys:
                    self._removals.touch(k)

    def wait_idle(self, timeout_s: float | None = None, *, offload: bool = True, promotion: bool = True,
                  events: bool = True) -> bool:
        """Block until the chosen background workers have nothing queued or in flight: the offload
        worker (SSD writes and watermark passes), the promotion worker, and the residency event
        bus (every event published so far delivered). Unlike :meth:`flush` it writes nothing
        itself (objects evicted from the tier below are not written back). One ``timeout_s`` for
        all of them; False on timeout, or when a worker died with work left. Thread-safe; waits
        with no store lock held; may be called after close."""
        deadline = Deadline(timeout_s)
        waits = [w.wait_idle for w, on in ((self._offloader, offload), (self._promoter, promotion)) if on]
        if events:
            waits.append(self._bus.wait_idle)
        return all(wait(deadline.left()) for wait in waits)

    def residency_seq(self) -> int:
        """The ``seq`` of the last residency event published (see ``ResidencyBus.published_seq``):
        a subscriber whose latest event has it knows every change made before this call. Thread-safe."""
        return self._bus.published_seq

    def note_stuck_threads(self, count: int) -> None:
        """Count ``count`` threads of this store's users (a connector's I/O pool, lookup service,
        sweeper) still running when their close() reached its deadline, in
        ``store.thread_join_timeouts`` (they logged each by name). Thread-safe; works after close."""
        if count > 0:
            with self._lock:
                self.metrics_counters.store.thread_join_timeouts += count

    def note_worker_error(self) -> None:
        """Count one exception that escaped a background thread of this store's users (the lookup
        service, the epoch sweeper; already logged with its traceback) in ``store.worker_errors``.
        Thread-safe; works after close."""
        self._worker_error()

    def _worker_error(self) -> None:
        """A background worker's exception (already logged with its traceback): counted."""
        with self._lock:
            self.metrics_counters.store.worker_errors += 1

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise StoreClosedError("the store is closed")

    @contextlib.contextmanager
    def _call(self, latency: LatencyHistogram | None = None) -> Iterator[None]:
        """Count a public call in flight (close() waits for it); refuse it once close() began.
        With ``latency``, the call's time is observed there (under the lock this takes anyway)."""
        with self._lock:
            self._check_open()
            self._calls += 1
        t0 = time.perf_counter()
        try:
            yield
        except StoreClosedError:
            raise
        except Exception as e:
            # Only when close() began during this call (it leaves the tiers open for a call it
            # gave up on, but the store is closed all the same).
            if self._closed:
                raise StoreClosedError("the store was closed during the call") from e
            raise
        finally:
            with self._lock:
                if latency is not None:
                    latency.observe(time.perf_counter() - t0)
                self._calls -= 1
                if not self._calls:
                    self._changed.notify_all()
                last = self._last_user_left()
            if last:  # close() gave up on this call and left the tiers open for it
                self._close_tiers(None)

    @property
    def _ssd(self) -> Any:
        """The SSD tier's backend, or None (for closing it, and for tools and tests that look
        underneath the store)."""
        return next((t.backend for t in self._below if isinstance(t, SsdTier)), None)

    def _ticket(self) -> Ticket:
        """(lock held) A ticket for work about to ask or move something below DRAM outside the
        lock: asked under the lock after whether a remove or an eviction intervened."""
        return Ticket(self._removals, self._evictions)

    def _live(self, e: Entry) -> bool:
        """Whether ``e`` is still the index's entry for its key (lock held): a removed entry is
        not, though readers or an offload may still hold its bytes."""
        return self._dram.entries.get(e.key) is e

    def _detach(self, e: Entry) -> None:
        """Take ``e`` out of the index for a remove (lock held). Its bytes are freed now when
        nobody holds them, else by whoever lets go last (a reader, an offload, the writer)."""
        if e.pins:
            self._void_pin(e.key, e.pins, e.pin_deadline)
        if e.state is EntryState.READY and e.leases == 0:
            self._dram.drop(e.key)
            return
        del self._dram.entries[e.key]
        if e.state is EntryState.READY:
            self._dram.policy.on_remove(e.key)

    def _unlease(self, e: Entry) -> None:
        """Let go of a lease (lock held); the last holder of a removed entry frees its bytes."""
        e.leases -= 1
        if e.leases == 0 and not self._live(e):
            self._dram.free(e)

    def _release_detached(self, e: Entry) -> None:
        """The writer of a WRITING entry that a remove took out of the index frees its bytes."""
        self._dram.free(e)









