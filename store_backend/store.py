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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

from store_backend.api import StoreClosedError  # defined there; re-exported here
from store_backend.coherence import EvictionClock, KnownBelow, LossLedger, RemovalTracker, Ticket
from store_backend.config import StoreConfig, load_config
from store_backend.dram import Entry, EntryState, HostDramTier
from store_backend.engine import BatchWorker
from store_backend.metrics import (
    FailureCounters,
    LatencyHistogram,
    QueueGauges,
    SlotGauges,
    StoreMetrics,
    StoreStats,
)
from store_backend.plans import (
    EvictPass,
    Verdict,
    VictimFacts,
    demotion_bytes,
    demotion_split,
    evict_pass_order,
    room_owed,
    should_promote,
    victim_verdict,
)
from store_backend.policies.admission import AdmissionPolicy, AdmitAll, make_admission, policy_uses
from store_backend.residency import ALL_TIERS, ResidencyBus, ResidencyEvent, Subscriber
from store_backend.checksum import object_checksum
from store_backend.slots import (
    MAX_HELD_FRACTION,
    PinRow,
    Reservation,
    SegmentInfo,
    SlotKind,
    SlotLease,
    SlotRow,
    SlotTable,
    check_group,
)
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.factory import open_ssd_backend
from store_backend.tiers.base import Tier
from store_backend.tiers.ssd import SsdTier
from store_backend.threads import JOIN_GRACE_S, Deadline, close_within
from store_backend.types import (
    Buffer,
    FlushReport,
    ReadResult,
    Status,
    byte_view,
    check_batch,
    check_key,
    check_ttl_s,
    check_wait_s,
    copy_bytes,
    nbytes_of,
)

logger = logging.getLogger(__name__)

# Attempts to write one object to SSD (the first included) before DRAM may drop it unpersisted.
MAX_OFFLOAD_ATTEMPTS = 3

_HIT_TABLE_MAX = 1 << 16  # SSD hit counters kept for promotion decisions

# How long a removal retries an SSD copy that is busy (a reader of the offset backend holds it).
_REMOVE_BUSY_S = 5.0

# How long a remove waits for an offload of its key that was writing when it began to land its
# copy and delete it again (so that no kill afterwards can bring the removed bytes back).
_REMOVE_LANDED_S = 10.0

# SSD lookups made outside the store lock that are asked again when their key's visibility changed
# meanwhile (see RemovalTracker.changed_since), before the key is taken as absent.
_LOOKUP_TRIES = 3

# How a flush report starts the reason of an object whose SSD write failed.
_WRITE_FAILED = "its SSD write answered"

# Waits on the store's condition wake up at least this often to look again (a backstop: every
# change that ends a wait also notifies).
_WAIT_SLICE_S = 0.5


def _count_failure(failures: FailureCounters, status: Status) -> None:
    """Count a failed SSD read or write under its kind (lock held)."""
    if status is Status.CORRUPT:
        failures.checksum += 1
    elif status in (Status.NO_SPACE, Status.TOO_LARGE):
        failures.capacity += 1
    else:
        failures.io_error += 1


def _check_items(items: Sequence[Any], kind: type, name: str) -> list[Any]:
    """``items`` as a list, or TypeError naming ``name`` (``name[i]``) unless it is a sequence of
    ``kind`` (checked before anything changes)."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{name} must be a sequence of {kind.__name__}, got {type(items).__name__}")
    out = list(items)
    for i, item in enumerate(out):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] must be a {kind.__name__}, got {item!r}")
    return out


class TieredStore:
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

    # -- lifecycle ---------------------------------------------------------------------------------
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
        t = threading.Thread(target=run, name="kv-close-flush", daemon=True)
        t.start()
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

    # -- writes ------------------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        parents: Sequence[str | None] | None = None,
    ) -> list[Status]:
        """Store immutable objects; OK once in DRAM (offload to SSD follows in the background).

        Per key: OK, EXISTS (already stored; bytes kept), INVALID_KEY, TOO_LARGE, NO_SPACE (no room
        can be made: every resident object is leased, pinned or being written, or, with an SSD
        tier, not written down yet: an acknowledged object is never dropped from DRAM before its
        SSD copy exists, so the new put gives way). Never does I/O itself; when DRAM is full of
        objects the offload has not written yet, it waits for that offload to make room, up to
        ``offload.put_wait_s`` for the whole call (0: refused at once), so call it off the engine's
        thread; ``close()`` ends the wait (NO_SPACE). A NO_SPACE is a save not stored, never an
        error. A put that begins after a ``remove`` of its key returned stores the new bytes.
        """
        check_batch(keys, buffers)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(parents)} parents")
        views = [byte_view(b) for b in buffers]
        with self._call(self.metrics_counters.latency.put):
            return self._put(keys, views, parents)

    def _put(self, keys: Sequence[str], views: list[memoryview], parents: Sequence[str | None] | None,
             ) -> list[Status]:
        out = [Status.OK] * len(keys)
        reserved = self._reserve_batch(keys, [v.nbytes for v in views], parents, out,
                                       wait_s=self.config.offload.put_wait_s)
        self._finish_put(views, reserved)
        self._kick_watermark()
        return out

    def _kick_watermark(self) -> None:
        if self._backing is not None and self._started and self.config.offload.policy == "watermark" \
                and self._over_high_watermark():
            self._offloader.kick()

    def _reserve_batch(self, keys: Sequence[str], sizes: list[int], parents: Sequence[str | None] | None,
                       out: list[Status], slot: tuple[int, float, dict[int, int], tuple[str, int]] | None = None,
                       *, wait_s: float = 0.0, room_owed: set[int] | None = None) -> list[tuple[int, Entry]]:
        """put's first half, shared with :meth:`reserve`: a WRITING entry for each key to be stored
        (an answer in ``out`` for the others), after asking the tiers below that answer from memory
        whether the key is already stored (no store lock held while they are asked). ``slot``
        (owner, deadline, tokens, account): record each reservation in the slot table, under the
        account's limits, its token in ``tokens`` by key index. ``wait_s``: how long the batch may
        wait for the offload to make DRAM room; ``room_owed``: see :meth:`_reserve_puts`."""
        valid = [check_key(k) is None for k in keys]
        # Asked before taking the lock (the SSD index has its own): a key that reaches SSD meanwhile
        # only costs a redundant DRAM copy of the same immutable bytes. A key being removed is
        # hidden, so a put racing the removal of an older copy stores its bytes; a hit whose key
        # changed visibility since the lookup (an old copy landed after a remove and was deleted
        # just after the lookup saw it) is asked again, and after a few tries taken as a miss.
        # Only tiers that answer from memory are asked (a pool's lookup is a network round trip).
        # A key whose DRAM copy was dropped for its SSD copy between the lookup and the lock (it is
        # then known below) is asked once more: without that, the put stored its bytes beside the
        # SSD copy, and a put of other bytes under a key removed while a node was unreachable (the
        # pool's case) could later be served the old SSD bytes; on the last try it is EXISTS.
        local = [t for t in self._below if t.traits.local_index]
        on_ssd = [False] * len(keys)
        on_backing = [False] * len(keys)  # the hit was in the backing tier
        asked_at: list[Ticket | None] = [None] * len(keys)
        ask = [i for i, ok in enumerate(valid) if ok] if local else []
        tries = 0
        reasked: set[int] = set()  # asked again because they turned up known below (see above)
        with self._lock:
            first = self._ticket()
        while True:
            if ask:
                with self._lock:
                    ticket = self._ticket()
                found = [False] * len(ask)
                for t in local:
                    rest = [j for j, hit in enumerate(found) if not hit]
                    if not rest:
                        break
                    for j, hit in zip(rest, t.contains([keys[ask[j]] for j in rest])):
                        found[j] = hit
                        on_backing[ask[j]] = hit and t is self._backing
                for i, hit in zip(ask, found):
                    on_ssd[i], asked_at[i] = hit, ticket
            with self._lock:
                stale = [i for i in ask if on_ssd[i] and (t := asked_at[i]) is not None and t.changed(keys[i])]
                landed = [i for i in range(len(keys)) if valid[i] and local and not on_ssd[i] and i not in reasked
                          and keys[i] in self._known_below and keys[i] not in self._dram.entries
                          and not self._removals.hidden(keys[i])]
                reasked.update(landed)
                stale = sorted({*stale, *landed})
                tries += 1
                if stale and tries < _LOOKUP_TRIES:
                    ask = stale
                    continue
                for i in stale:
                    # Out of tries: a copy whose visibility kept changing is taken as a miss; a key that
                    # turned up known below only now (its DRAM copy dropped for its SSD copy since the
                    # last lookup) is EXISTS, never a second object beside the SSD copy.
                    on_ssd[i] = i in landed
                reserved = self._reserve_puts(keys, sizes, parents, valid, on_ssd, out, slot, wait_s, room_owed)
                for i, st in enumerate(out):  # EXISTS because it is below: a parent admission may ask of
                    if st is Status.EXISTS and on_ssd[i] and on_backing[i] and keys[i] not in self._dram.entries \
                            and not first.evicted(keys[i]):
                        self._known_below.add(keys[i])
                break
        return reserved

    def _reserve_puts(self, keys: Sequence[str], sizes: list[int], parents: Sequence[str | None] | None,
                      valid: list[bool], on_ssd: list[bool], out: list[Status],
                      slot: tuple[int, float, dict[int, int], tuple[str, int]] | None = None,
                      wait_s: float = 0.0, room_owed: set[int] | None = None) -> list[tuple[int, Entry]]:
        """(lock held) A WRITING entry for each key that is to be stored; the others' answers in ``out``.
        With ``slot``, each is recorded in the slot table (see :meth:`_reserve_batch`). ``room_owed``
        collects the indexes refused NO_SPACE while writes that will make room were owed (a caller
        that waited less than it may wait can ask again for those).

        A key that finds DRAM full of objects not yet written down (nothing clean to evict, writes
        owed: :meth:`_make_room`) waits for the offload to make room, up to ``wait_s`` for the
        whole batch (the store lock is let go meanwhile; offload completions and close wake it),
        then is refused NO_SPACE (``put_no_space_dirty``): the newest put gives way, never an
        older acknowledged object. Everything is looked at again after a wait."""
        m = self.metrics_counters
        reserved: list[tuple[int, Entry]] = []
        until: float | None = None  # the batch's deadline, set at its first wait
        waited_s = 0.0  # time spent waiting, added to the slot tokens' TTL (it starts after the wait)
        self._expire_slots()  # an expired reservation no longer holds its key (for put too)
        for i, key in enumerate(keys):
            if not valid[i]:
                out[i] = Status.INVALID_KEY
                continue
            size = sizes[i]
            block = self._dram.block_bytes(size)  # what the slot takes from the arena and its share
            if size > self.config.max_object_bytes or not self._dram.fits_ever(size) \
                    or (slot is not None and self._slots.too_large(block)):
                out[i] = Status.TOO_LARGE
                continue
            waits = 0
            while True:
                entry = None
                if key in self._dram.entries or (on_ssd[i] and not self._removals.hidden(key)):
                    out[i] = Status.EXISTS
                    m.store.put_exists += 1
                elif slot is not None and not self._slots.admits(slot[3], block):
                    out[i] = Status.NO_SPACE  # this owner holds its share of the arena (or of tokens)
                    m.store.slot_refused += 1
                else:
                    entry, owed = self._make_room(key, size, None if parents is None else parents[i], promotion=False)
                    if entry is None and owed and wait_s > 0:
                        if until is None:
                            until = time.monotonic() + wait_s
                        t0 = time.monotonic()
                        if self._wait_for_room(until):
                            waits += 1
                            waited_s += time.monotonic() - t0
                            continue  # look again: the key may be stored by now, or room made
                        waited_s += time.monotonic() - t0
                    if entry is None:
                        out[i] = Status.NO_SPACE
                        m.store.put_no_space += 1
                        if owed:  # DRAM is full of objects not on SSD yet: the new put gives way
                            m.store.put_no_space_dirty += 1
                            if room_owed is not None:
                                room_owed.add(i)
                        m.dram.failures.capacity += 1
                if waits:
                    m.store.put_room_waits += 1
                break
            if entry is None:
                continue
            if slot is not None:
                slot[2][i] = self._slots.add(SlotKind.RESERVATION, entry, slot[0], slot[1] + waited_s, block,
                                             account=slot[3])
                m.store.slot_reserves += 1
            reserved.append((i, entry))
        return reserved

    def _room_wait_s(self, room_wait_s: float | None) -> float:
        """A caller's ``room_wait_s`` checked (None: ``offload.put_wait_s``); ValueError naming it."""
        wait = check_wait_s("room_wait_s", room_wait_s, none_ok=True)
        return self.config.offload.put_wait_s if wait is None else wait

    def _wait_for_room(self, until: float) -> bool:
        """(lock held) Wait for the offload to make DRAM room, until ``until``: woken by an SSD
        write landing (or a demotion dropping what it wrote) and by close; the store lock is let go
        meanwhile. False when there is no time left or close began (the caller refuses)."""
        left = until - time.monotonic()
        if left <= 0 or self._closing:
            return False
        if self.config.offload.policy == "watermark":
            self._offloader.kick()  # DRAM is full: a demotion pass now, not at the next idle tick
        self._room.wait(min(left, _WAIT_SLICE_S))
        self._expire_slots()  # an expired reservation gives its room back
        return not self._closing

    def _finish_put(self, views: list[memoryview], reserved: list[tuple[int, Entry]]) -> None:
        """Copy the bytes in (no lock held), then commit each entry and queue its offload."""
        arena = self._dram.arena.view
        copied = 0
        try:
            for i, entry in reserved:
                copy_bytes(arena[entry.offset:entry.offset + entry.size], views[i])
                if self._checksums:
                    entry.checksum = object_checksum(entry.key, views[i])
                copied += 1
        finally:
            with self._lock:
                for _i, entry in reserved[copied:]:  # the copy failed: forget the half-written entries
                    if self._live(entry):
                        self._dram.drop(entry.key)
                    else:
                        self._release_detached(entry)
                self._commit_entries([e for _i, e in reserved[:copied]])

    def _commit_entries(self, entries: list[Entry]) -> None:
        """(lock held) Make WRITING entries whose bytes are in READY, as put and slot commits do:
        each takes a put number (so a flush covers it), publishes ``stored`` and, in eager mode, is
        queued for offload. An entry a remove (or its reservation's expiry) took out of the index
        meanwhile is freed instead."""
        m = self.metrics_counters
        queued: list[Entry] = []
        stored: list[ResidencyEvent] = []
        eager = self._backing is not None and self._started and self.config.offload.policy == "eager"
        for entry in entries:
            if not self._live(entry):  # removed while its bytes were copied in
                self._release_detached(entry)
                continue
            self._dram.commit(entry)
            self._put_seq += 1
            entry.put_seq = self._put_seq
            self._losses.clear(entry.key)
            self._known_below.discard(entry.key)
            stored.append(ResidencyEvent("stored", entry.key, "dram", entry.size))
            m.store.puts += 1
            m.dram.bytes_written += entry.size
            if eager:
                queued.append(entry)
        self._bus.publish(stored)
        self._queue_offload(queued)
        if stored:
            self._commits += 1
            self._slot_changed.notify_all()  # exists(wait_s) and lease(wait_pending_s) waiters

    def _admitted(self, e: Entry, parent_on_ssd: bool) -> bool:
        """Whether the SSD admission policy wants ``e`` written, on the facts as they are now (lock
        held). Its prefix counts as stored when it is on SSD or in DRAM and not declined itself, so
        a declined parent declines its children in turn."""
        pe = self._dram.entries.get(e.parent) if e.parent is not None else None
        parent_stored = e.parent is None or parent_on_ssd or (pe is not None and not pe.declined)
        return self._admission.admit(e.key, e.size, uses=policy_uses(self._dram.policy, e.key),
                                     parent_stored=parent_stored)

    def _parent_stored(self, e: Entry) -> bool:
        """(lock held) Whether ``e``'s parent is believed in the backing tier, from memory only:
        dropped from DRAM while persisted and not evicted below or removed since (a parent in DRAM
        is judged by :meth:`_admitted` itself)."""
        return e.parent is not None and e.parent not in self._dram.entries and e.parent in self._known_below

    def _victim_facts(self, e: Entry, now: float) -> VictimFacts:
        """(lock held) What a victim decision needs to know of ``e``; admission is asked only for a
        declined entry (the only one whose verdict depends on it)."""
        # A copy of another node's object (e.replica) goes as a persisted one does: nothing is lost.
        return VictimFacts(key=e.key, size=e.size, evictable=e.evictable(now), persisted=e.persisted or e.replica,
                           declined=e.declined, readmit=e.declined and self._admitted(e, self._parent_stored(e)),
                           offload_failures=e.offload_failures, offload_queued=e.offload_queued)

    def _dropped_from_dram(self, e: Entry, events: list[ResidencyEvent]) -> None:
        """(lock held) ``e`` is being dropped from DRAM for room: remember it below if it is there,
        and say so to the bus (``lost`` when no other copy is left)."""
        if e.persisted:
            self._known_below.add(e.key)
        events.append(ResidencyEvent("evicted", e.key, "dram", e.size, lost=not e.clean))

    def _reserve(self, key: str, size: int, parent: str | None, *, promotion: bool) -> Entry | None:
        """Make a WRITING entry, evicting by policy (lock held); None when no room can be made now.
        Promotions evict only clean entries. See :meth:`_make_room`."""
        return self._make_room(key, size, parent, promotion=promotion)[0]

    def _make_room(self, key: str, size: int, parent: str | None, *, promotion: bool) -> tuple[Entry | None, bool]:
        """Make a WRITING entry, evicting by policy (lock held): (the entry or None, whether the
        offload owes room, so a put may wait for it: see :func:`room_owed`). Promotions evict only
        clean entries; no pass evicts a dirty entry whose SSD write is still owed (only one whose
        writes failed ``MAX_OFFLOAD_ATTEMPTS`` times goes, counted in ``dropped_unpersisted``).

        Which entries may go is :func:`victim_verdict`'s decision over in-memory facts; no lower
        tier is asked anything here (the SSD tier's eviction reports keep ``persisted`` honest)."""
        m = self.metrics_counters
        # Dirty entries met while looking for clean victims that need a write now: their SSD write
        # failed or was never queued, or admission now wants one it declined before.
        retry: list[Entry] = []
        events: list[ResidencyEvent] = []
        pending = False  # met a dirty entry whose write is coming (or was just queued)
        entry = None
        now = time.monotonic()
        passes = evict_pass_order(self._backing is not None)
        if promotion and EvictPass.CLEAN not in passes:
            # No backing tier (a pool alone below DRAM): a promotion still evicts clean entries
            # only (replicas of other nodes' objects), never the only copy of something.
            passes = (EvictPass.CLEAN,)
        # The offload workers run: every dirty entry is owed a write, and one that has none queued
        # gets one here (write_all). Those writes are queued for about the room this call needs
        # (a failed policy scan meets every dirty entry): a watermark store under pressure writes
        # what eviction needs, not all of DRAM; a waiting put asks again as they land.
        write_all = self._backing is not None and self._started and not self._closing
        queued_bytes = 0
        for evict_pass in passes:
            if promotion and evict_pass is not EvictPass.CLEAN:
                break

            def evict_ok(e: Entry, _p: EvictPass = evict_pass) -> bool:
                nonlocal pending, queued_bytes
                verdict = victim_verdict(self._victim_facts(e, now), evict_pass=_p,
                                         max_attempts=MAX_OFFLOAD_ATTEMPTS, write_all=write_all)
                if verdict is Verdict.WRITE_BACK and (queued_bytes < max(size, 1) or e.offload_failures or e.declined):
                    e.declined = False  # admission wants it now (or it was never declined)
                    if not e.offload_queued:
                        e.offload_queued = True
                        retry.append(e)
                        queued_bytes += e.size
                if verdict in (Verdict.WRITE_BACK, Verdict.WAIT):
                    pending = True
                return verdict is Verdict.EVICT

            def on_evict(e: Entry) -> None:
                m.dram.evictions += 1
                self._dropped_from_dram(e, events)
                if self._backing is not None and not e.clean:  # its writes failed MAX_OFFLOAD_ATTEMPTS times
                    m.store.dropped_unpersisted += 1
                    self._losses.record(e.key, e.put_seq, "evicted from DRAM before it reached SSD" + (
                        f" ({e.offload_failures} failed or refused writes)" if e.offload_failures else ""))

            entry = self._dram.reserve(key, size, parent, evict_ok, on_evict)
            if entry is not None:
                break
        self._bus.publish(events)
        self._write_back(retry)
        owed = entry is None and room_owed(pending, self._writing_bytes > 0,
                                           self._started and not self._offloader.dead and not self._closing)
        return entry, owed

    def _queue_offload(self, entries: list[Entry], *, front: bool = False) -> int:
        """(lock held) The one way onto the offload queue: queue the SSD writes of ``entries``
        (at the queue's head with ``front``) and mark them ``offload_queued``; returns how many
        were refused. The queue takes a prefix; what it refuses (all of it before ``start()``) is
        not queued and not marked: the next eviction queues it again (eager mode), or a demotion
        pass or a flush writes it (watermark mode). A refusal is not a failed write: it never
        brings an entry nearer to being dropped unpersisted (see :func:`victim_verdict`)."""
        if not entries:
            return 0
        refused = len(entries)
        if self._started:
            refused = self._offloader.submit([e.key for e in entries], front=front)
            self.metrics_counters.store.offload_queue_full += refused
        for n, e in enumerate(entries):
            e.offload_queued = n < len(entries) - refused
        return refused

    def _write_back(self, retry: list[Entry]) -> None:
        """(lock held) Queue the offload of dirty entries eviction met that need a write now
        (counted as retries when queued)."""
        queued = len(retry) - self._queue_offload(retry)
        if self._started:
            self.metrics_counters.store.offload_retries += queued

    def _on_below_evicted(self, tier: Tier, keys: list[str]) -> None:
        """``tier`` evicted ``keys`` on its own (called by it, in the thread of the put that
        evicted, as the keys leave its index, possibly under the tier's lock; never under the store
        lock, which is taken here after the tier's). In-memory work only: never calls a tier, and
        the bus's publish never blocks. When it is the
        backing tier, each DRAM copy is dirty again and the eviction is numbered for offloads in
        flight (:class:`EvictionClock`); the bus hears of it in any case."""
        backing = tier is self._backing
        with self._lock:
            events: list[ResidencyEvent] = []
            for key in keys:
                e = self._dram.entries.get(key)
                if backing:
                    self._evictions.stamp(key)
                    self._known_below.discard(key)
                    if e is not None and e.persisted:
                        self._lost_below(e)
                live = e is not None and e.state is EntryState.READY
                events.append(ResidencyEvent("evicted", key, tier.name, e.size if e is not None else 0,
                                             lost=not live))
            self._bus.publish(events)

    @staticmethod
    def _lost_below(e: Entry) -> None:
        """(lock held) ``e``'s copy below is gone: dirty again. It counts as one failed write (the
        copy did not stay), so that DRAM eviction writes it back before it may drop it
        (:func:`victim_verdict`), and watermark demotion and flush write it as any dirty entry."""
        e.persisted = False
        e.offload_failures = max(1, e.offload_failures)

    # -- slots: reserve -> write -> commit/abort, lease -> read -> release ------------------------
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = 60.0, owner: int = 0, group: int | None = None,
                room_wait_s: float | None = 0.0) -> list[Reservation]:
        """Reserve an arena slot of ``sizes[i]`` bytes for each key, for the caller to fill
        through ``Reservation.view`` and then :meth:`commit` (or :meth:`abort`). Never blocks on
        I/O; thread-safe.

        ``room_wait_s``: when DRAM is full of objects the offload has not written to SSD yet, how
        long the call may wait (blocking, the store lock let go) for that offload to make room
        before it answers NO_SPACE, for the whole batch; None: the config's
        ``offload.put_wait_s``, as :meth:`put` waits. The default, 0, never waits: reserve is
        called where a wait would stall others (vLLM's slot saves, on the engine's thread; the
        node service, inline on its event loop), so a caller that may wait asks for it (the node
        service: from a thread, after an inline try with 0 was refused). ``close()`` ends a
        wait (NO_SPACE). A number outside [0, ``MAX_PIN_TTL_S``]: ValueError naming it.

        Per key: OK (with token, offset into the arena/segment, writable view), EXISTS (stored
        already, or reserved by another writer), INVALID_KEY, TOO_LARGE (permanent: larger than
        the arena, ``max_object_bytes``, or one share, ``max_held_fraction`` of the arena), NO_SPACE
        (nothing evictable, or the share holds ``max_held_fraction`` of the arena or 65536 tokens
        already; a slot counts the allocator's whole block, alignment units, against it). A
        reserved key is invisible to readers (``get_into``, ``lease``, ``contains``, ``exists``)
        until it is committed. ``ttl_s`` bounds the result, not the memory: a commit after it
        answers IO_ERROR and the key is free for another writer at once, but the slot's bytes stay
        allocated (the caller may still be writing them) until the owner commits, aborts, or
        :meth:`reclaim` runs for it. ``owner`` names the holder (the node service: its connection),
        whose tokens ``reclaim`` ends; ``group`` names the share the tokens count against (the
        node service: the peer process, so its connections share one limit; default: the owner's
        own). Misuse (mismatched lengths, a negative or non-integer size, ``ttl_s`` outside (0,
        ``MAX_PIN_TTL_S``]) raises ValueError/TypeError naming the argument."""
        check_batch(keys)
        if len(sizes) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(sizes)} sizes")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(parents)} parents")
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"sizes[{i}] (for key {keys[i]!r}) must be a byte count >= 0, got {n!r}")
        ttl_s = check_ttl_s(ttl_s)
        wait_s = self._room_wait_s(room_wait_s)
        account = self._slots.account(owner, check_group(group))
        out = [Status.OK] * len(keys)
        tokens: dict[int, int] = {}
        with self._call(self.metrics_counters.latency.put):  # the store's part of a slot put
            owed: set[int] = set()
            reserved = self._reserve_batch(keys, list(sizes), parents, out,
                                           (owner, time.monotonic() + ttl_s, tokens, account), wait_s=wait_s,
                                           room_owed=owed)
            arena = self._dram.arena.view
            res = [Reservation(st, k, room_owed=i in owed) for i, (k, st) in enumerate(zip(keys, out))]
            for i, e in reserved:
                res[i] = Reservation(Status.OK, e.key, e.size, tokens[i], e.offset, arena[e.offset:e.offset + e.size])
            return res

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0,
               checksums: Sequence[int | None] | None = None) -> list[Status]:
        """Make reserved objects visible, their bytes as the caller wrote them; per reservation:
        OK (stored; also when a ``remove`` of the key came in between, as a put answers: the bytes
        are dropped), IO_ERROR (its TTL had passed: nothing stored, the slot freed; or the token is
        unknown, already used, or held by another owner: nothing changes), or the reservation's
        own status when it was not OK. Each commit takes a put number (a later ``flush`` covers
        it), publishes ``stored``, and is queued for offload as a put is. Thread-safe; no I/O.
        An item that is not a :class:`Reservation`: TypeError naming it, nothing committed.
        ``checksums`` (one per reservation; None: not given): the writer's object checksum of
        what it wrote, kept with the object when the store keeps checksums; one not given is
        computed here over the slot's bytes (no lock held)."""
        reservations = _check_items(reservations, Reservation, "reservations")
        if checksums is not None and len(checksums) != len(reservations):
            raise ValueError(f"got {len(reservations)} reservations but {len(checksums)} checksums")
        sums: list[int | None] = [None] * len(reservations)
        computed = [False] * len(reservations)  # summed here over the range the caller's item names
        if self._checksums:
            arena = self._dram.arena.view
            for i, r in enumerate(reservations):
                given = None if checksums is None else checksums[i]
                if given is not None:
                    if not isinstance(given, int) or isinstance(given, bool) or not 0 <= given < 1 << 64:
                        raise ValueError(f"checksums[{i}] must be an unsigned 64-bit int or None, got {given!r}")
                    sums[i] = given
                elif r.status is Status.OK and 0 <= r.offset and r.offset + r.nbytes <= len(arena):
                    sums[i] = object_checksum(r.key, arena[r.offset:r.offset + r.nbytes])
                    computed[i] = True
        out: list[Status] = []
        with self._call(), self._lock:
            self._expire_slots()
            m = self.metrics_counters
            live: list[Entry] = []
            for r, checksum, here in zip(reservations, sums, computed):
                if r.status is not Status.OK:
                    out.append(r.status)
                    continue
                row = self._slots.get(r.token, owner, SlotKind.RESERVATION)
                if row is None:
                    out.append(Status.IO_ERROR)
                    m.store.slot_foreign += 1
                    continue
                self._slots.take(r.token)
                if row.expired:
                    self._end_reservation(row.entry)
                    out.append(Status.IO_ERROR)
                    continue
                if self._checksums:
                    e = row.entry
                    if checksum is None or (here and (e.offset != r.offset or e.size != r.nbytes or e.key != r.key)):
                        # Not computed above over this entry's own slot: its bytes are done, sum them.
                        checksum = object_checksum(e.key, self._dram.arena.view[e.offset:e.offset + e.size])
                    e.checksum = checksum
                live.append(row.entry)
                out.append(Status.OK)
                m.store.slot_commits += 1
            self._commit_entries(live)
        self._kick_watermark()
        return out

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None:
        """Give reserved slots back unstored (the key stays absent; another writer may store it).
        A token that is unknown, used, or another owner's is left alone. Thread-safe; no I/O.
        An item that is not a :class:`Reservation`: TypeError naming it, nothing aborted."""
        reservations = _check_items(reservations, Reservation, "reservations")
        with self._call(), self._lock:
            self._expire_slots()
            for r in reservations:
                row = self._slots.get(r.token, owner, SlotKind.RESERVATION) if r.status is Status.OK else None
                if row is None:
                    if r.status is Status.OK:
                        self.metrics_counters.store.slot_foreign += 1
                    continue
                self._slots.take(r.token)
                self._end_reservation(row.entry)
                self.metrics_counters.store.slot_aborts += 1
            self._slot_changed.notify_all()  # lease(wait_pending_s) waiters: the key is not coming

    def _end_reservation(self, e: Entry) -> None:
        """(lock held) Free a reservation's slot unstored: drop the entry if it is still the
        index's, else (removed, or detached at expiry) just its bytes."""
        if self._live(e):
            self._dram.drop(e.key)
        else:
            self._release_detached(e)

    def lease(self, keys: Sequence[str], *, ttl_s: float = 60.0, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0, group: int | None = None,
              local_only: bool = False) -> list[SlotLease]:
        """Hold objects' bytes in the arena for the caller to read through ``SlotLease.view``,
        until :meth:`release`: neither evicted nor overwritten meanwhile (a ``remove`` takes the
        key at once; the bytes are freed by the last releaser). Thread-safe.

        Per key: OK (token, offset, read-only view of the object's bytes), NOT_FOUND (absent,
        still being written: reserved, or being promoted or staged in from below by another call,
        which ``wait_pending_s`` waits for; or removed during a stage-in), INVALID_KEY, TOO_LARGE
        (permanent: the object is larger than one share, see :meth:`reserve`), NO_SPACE (no clean
        room to stage it in, or the share of ``owner``/``group`` is held: see :meth:`reserve`; a
        stage-in counts the batch's own slots as it goes and refuses before it evicts), CORRUPT/IO_ERROR (the
        stage-in read failed). An object only in a lower tier is, with ``stage_in``, read into a
        slot first (blocks on that read; it evicts clean objects only): the slot becomes the
        object's DRAM copy when the promotion rule says so, else a transient slot freed at
        release. ``wait_pending_s`` > 0: a key being written into DRAM (reserved, not committed;
        being promoted or staged in by another call, also one that began after this call looked)
        is waited for up to that long, then leased, or staged in again when that write was given
        up and a lower tier still holds the object. ``ttl_s`` bounds the result:
        a release after it answers False, but the bytes stay held until the release or
        :meth:`reclaim`. ``local_only``: stage in from this node's tiers only, never from the pool
        (what a peer's transport asks: the pool's read must not go round the pool again)."""
        check_batch(keys)
        ttl_s = check_ttl_s(ttl_s)
        account = self._slots.account(owner, check_group(group))
        check_wait_s("wait_pending_s", wait_pending_s)
        out = [SlotLease(Status.NOT_FOUND, k) for k in keys]
        m = self.metrics_counters
        below: list[int] = []
        until = time.monotonic() + wait_pending_s
        with self._call(self.metrics_counters.latency.get):  # the store's part of a slot get
            arena = self._dram.arena.view
            with self._lock:
                self._expire_slots()
                m.store.gets += len(keys)
                valid = [check_key(k) is None for k in keys]
                if wait_pending_s > 0:
                    self._wait_pending([k for k, ok in zip(keys, valid) if ok], until)
                    self._check_open()  # close began during the wait: hand out nothing
                for i, key in enumerate(keys):
                    if not valid[i]:
                        out[i] = SlotLease(Status.INVALID_KEY, key)
                        continue
                    e = self._dram.entries.get(key)
                    if e is None or e.state is not EntryState.READY:
                        m.dram.misses += 1
                        if e is None and stage_in and self._below:
                            below.append(i)
                        continue
                    out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
            tiers = self._local_tiers() if local_only else self._below
            while below:
                # A key another call began writing into DRAM after the wait above (a promotion
                # queued by a pin, another caller's stage-in, a put) is waited for too, within the
                # same bound, then leased from DRAM or, gone again, staged in again.
                busy = self._stage_in(keys, below, owner, account, ttl_s, out, tiers)
                if not busy or time.monotonic() >= until:
                    break
                below = []
                with self._lock:
                    self._wait_pending(sorted({keys[i] for i in busy}), until)
                    self._check_open()
                    for i in busy:
                        e = self._dram.entries.get(keys[i])
                        if e is None:
                            below.append(i)
                        elif e.state is EntryState.READY:
                            out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
        return out

    def _lease_entry(self, e: Entry, owner: int, account: tuple[str, int], ttl_s: float, source: str,
                     arena: memoryview) -> SlotLease:
        """(lock held) One more lease on ``e`` with a token whose TTL starts now (not before a wait
        or a stage-in read: the TTL is the caller's time to read), or NO_SPACE past the share's
        limits (TOO_LARGE: larger than a whole share). ``e`` must be held (indexed, or leased by
        this call): a freed entry's block may be another object's by now, so leasing one is a bug,
        refused (NOT_FOUND), counted and logged."""
        if e.freed:
            self._dram.double_frees += 1
            logger.error("lease of key %r asked for an arena block freed already; refused", e.key)
            return SlotLease(Status.NOT_FOUND, e.key)
        block = self._dram.block_bytes(e.size)
        if self._slots.too_large(block):
            return SlotLease(Status.TOO_LARGE, e.key)
        if not self._slots.admits(account, block):
            self.metrics_counters.store.slot_refused += 1
            return SlotLease(Status.NO_SPACE, e.key)
        e.leases += 1
        token = self._slots.add(SlotKind.LEASE, e, owner, time.monotonic() + ttl_s, block, source, account)
        self.metrics_counters.store.slot_leases += 1
        return SlotLease(Status.OK, e.key, e.size, token, e.offset,
                         arena[e.offset:e.offset + e.size].toreadonly(), e.checksum, source)

    def _wait_pending(self, keys: list[str], until: float) -> None:
        """(lock held) Wait until none of ``keys`` is being written (committed, aborted, expired or
        removed), or ``until``, or close began."""
        def pending() -> bool:
            return any((e := self._dram.entries.get(k)) is not None and e.state is EntryState.WRITING for k in keys)

        while not self._closing and pending():
            left = until - time.monotonic()
            if left <= 0:
                return
            self._slot_changed.wait(min(left, _WAIT_SLICE_S))
            self._expire_slots()

    def _stage_in(self, keys: Sequence[str], idx: list[int], owner: int, account: tuple[str, int], ttl_s: float,
                  out: list[SlotLease], tiers: Sequence[Tier]) -> list[int]:
        """Lease objects found only below DRAM by reading each into a slot (no store lock held
        while a tier is asked or reads). The slot is reserved as a WRITING entry under the key
        (evicting clean entries only, as a promotion does), so it stays invisible and a put of the
        key answers EXISTS; a remove meanwhile takes it, and so does a removal that began after the
        size lookup (``changed_since``): either way NOT_FOUND, never the removed bytes.

        Returns the indices (a key's repeats in the batch with it) left NOT_FOUND because another
        call began writing the key into DRAM meanwhile (a promotion, a stage-in, a put): the
        caller may wait for that write and ask again."""
        # A key named again in the batch is staged once and leased once more per repeat, in the
        # lock section that leases its first mention: once the lock is dropped a reclaim of the
        # owner, or an eviction, may free the entry.
        first: dict[str, int] = {}
        repeats: dict[int, list[int]] = {}  # leader index -> the indices naming its key again
        for i in idx:
            lead = first.setdefault(keys[i], i)
            if lead != i:
                repeats.setdefault(lead, []).append(i)
        leased: set[int] = set()  # leader indices whose lease was granted
        busy: list[int] = []  # leader indices whose key another call was writing
        self._stage_in_once(keys, list(first.values()), owner, account, ttl_s, out, repeats, leased, tiers, busy)
        for lead, more in repeats.items():
            if lead not in leased:  # no lease, no entry touched: the repeats answer as their leader
                for i in more:
                    out[i] = SlotLease(out[lead].status, keys[i])
        return [j for lead in busy for j in (lead, *repeats.get(lead, ()))]

    def _lease_repeats(self, e: Entry, more: list[int], owner: int, account: tuple[str, int], ttl_s: float,
                       source: str, arena: memoryview, out: list[SlotLease]) -> None:
        """(lock held, in the section that leased ``e`` for index ``lead``) One more lease of ``e``
        for each index in ``more`` (the same key named again)."""
        for i in more:
            out[i] = self._lease_entry(e, owner, account, ttl_s, source, arena)

    def _stage_in_once(self, keys: Sequence[str], idx: list[int], owner: int, account: tuple[str, int],
                       ttl_s: float, out: list[SlotLease], repeats: dict[int, list[int]], leased: set[int],
                       tiers: Sequence[Tier], busy: list[int]) -> None:
        """:meth:`_stage_in` for distinct keys; leases each key's repeats (``repeats``) with it,
        notes each leader whose lease it granted in ``leased`` and each it found being written by
        another call in ``busy``."""
        m = self.metrics_counters
        with self._lock:
            ticket = self._ticket()
            idx = [i for i in idx if not self._removals.hidden(keys[i])]
        sizes, absent, unanswered = self._locate_below(keys, idx, tiers)
        for i in unanswered:
            out[i] = SlotLease(Status.IO_ERROR, keys[i])
        staged: list[tuple[int, Entry, Tier]] = []
        staged_bytes = staged_tokens = 0  # what the staged slots will hold against the share
        arena = self._dram.arena.view
        with self._lock:
            self._check_open()
            for tier, n in absent:  # as get_into counts a tier's NOT_FOUND (_read_below)
                m.tier(tier.name).misses += n
            for i, (size, tier) in sizes.items():
                key = keys[i]
                e = self._dram.entries.get(key)
                if e is not None:  # stored (or being written) meanwhile
                    if e.state is EntryState.READY:
                        out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
                        if out[i].status is Status.OK:
                            leased.add(i)
                            self._lease_repeats(e, repeats.get(i, []), owner, account, ttl_s, "dram", arena, out)
                    else:
                        busy.append(i)
                    continue
                if ticket.removed(key):
                    continue  # removed since its size was asked: NOT_FOUND
                block = self._dram.block_bytes(size)
                if self._slots.too_large(block):
                    out[i] = SlotLease(Status.TOO_LARGE, key, source=tier.name)
                    continue
                # The slots this batch staged so far are not in the table yet: count them, so that a
                # key past the share is refused before it evicts anything (its repeats count too).
                n = 1 + len(repeats.get(i, ()))
                if not self._slots.admits(account, staged_bytes + block, staged_tokens + 1):
                    out[i] = SlotLease(Status.NO_SPACE, key, source=tier.name)
                    m.store.slot_refused += 1
                    continue
                e = self._reserve(key, size, None, promotion=True)
                if e is None:
                    out[i] = SlotLease(Status.NO_SPACE, key, source=tier.name)
                    m.dram.failures.capacity += 1
                    continue
                staged.append((i, e, tier))
                staged_bytes += n * block
                staged_tokens += n
        if not staged:
            return
        filled = self._fill([(e, tier) for _i, e, tier in staged])
        with self._lock:
            events: list[ResidencyEvent] = []
            for (i, e, tier), res in zip(staged, filled):
                tm = m.tier(tier.name)
                if not self._live(e) or ticket.removed(e.key):
                    # Removed while it was read (or between the size lookup and the reservation).
                    self._end_reservation(e)
                    out[i] = SlotLease(Status.NOT_FOUND, e.key)
                    continue
                if not res.ok:
                    self._end_reservation(e)
                    st = res.status if res.status in (Status.CORRUPT, Status.IO_ERROR) else Status.NOT_FOUND
                    if st is not Status.NOT_FOUND:
                        _count_failure(tm.failures, st)
                    tm.misses += 1
                    out[i] = SlotLease(st, e.key, source=tier.name)
                    continue
                tm.hits += 1
                tm.bytes_read += e.size
                m.store.slot_stage_ins += 1
                if self._closing:
                    promote = False
                elif not tier.traits.local_index:  # from another node: kept as a local replica at once
                    promote = self.config.promotion.enabled
                else:
                    promote = self._hit_below(e.key)
                if promote:
                    self._commit_promoted(e, tier, ticket, events)
                else:
                    # A transient slot outside the index: the lease is its only holder and its
                    # release frees it (see _unlease).
                    del self._dram.entries[e.key]
                if not self._slots.admits(account, self._dram.block_bytes(e.size)):  # the share was taken meanwhile
                    m.store.slot_refused += 1
                    if not promote:
                        self._release_detached(e)
                    out[i] = SlotLease(Status.NO_SPACE, e.key, source=tier.name)
                    continue
                out[i] = self._lease_entry(e, owner, account, ttl_s, tier.name, arena)
                if out[i].status is Status.OK:
                    leased.add(i)
                    self._lease_repeats(e, repeats.get(i, []), owner, account, ttl_s, tier.name, arena, out)
            self._bus.publish(events)
            self._slot_changed.notify_all()  # the staged keys are not being written any more

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]:
        """Give leased bytes back; per lease True when its bytes were stable for the whole lease
        (the caller may trust what it read), False when its TTL had passed (read it as failed),
        when the token is unknown, already released or another owner's (nothing changes), or when
        the lease's status was not OK. Thread-safe; no I/O. An item that is not a
        :class:`SlotLease`: TypeError naming it, nothing released."""
        leases = _check_items(leases, SlotLease, "leases")
        out: list[bool] = []
        m = self.metrics_counters
        with self._call(), self._lock:
            self._expire_slots()
            for ls in leases:
                row = self._slots.get(ls.token, owner, SlotKind.LEASE) if ls.status is Status.OK else None
                if row is None:
                    if ls.status is Status.OK:
                        m.store.slot_foreign += 1
                    out.append(False)
                    continue
                self._slots.take(ls.token)
                self._end_lease(row)
                m.store.slot_releases += 1
                if not row.expired and row.source == "dram":
                    m.dram.hits += 1
                    m.dram.bytes_read += row.entry.size
                out.append(not row.expired)
        return out

    def _end_lease(self, row: SlotRow) -> None:
        """(lock held) Let go of a lease's hold on its entry (the last holder of a removed or
        transient entry frees its bytes)."""
        e = row.entry
        if self._live(e):
            e.leases -= 1
            if not row.expired:
                self._dram.policy.on_access(e.key)
        else:
            self._unlease(e)

    def host_mapping(self) -> memoryview | None:
        """The whole DRAM arena (one mmap: a shared-memory segment, or anonymous), which every
        reservation's and lease's view is a slice of: for registering it with CUDA once
        (``mooncake_connector.cuda_host.register_host``). A borrow, valid until ``close``; never
        blocks. Raises StoreClosedError after close."""
        self._check_open()
        return self._dram.arena.view

    def reclaim(self, owner: int, keep: Collection[int] = ()) -> tuple[int, int]:
        """End every token ``owner`` holds but those in ``keep``, as if it aborted its reservations
        and released its leases (its process exited, or it said those tokens are void): their
        bytes are free again. Returns (reservations aborted, leases released). Thread-safe; no
        I/O; works on expired tokens."""
        n_res = n_lease = 0
        with self._call(), self._lock:
            self._expire_slots()
            for token in self._slots.tokens_of(owner):
                if token in keep:
                    continue
                row = self._slots.take(token)
                if row.kind is SlotKind.RESERVATION:
                    self._end_reservation(row.entry)
                    n_res += 1
                else:
                    self._end_lease(row)
                    n_lease += 1
            self.metrics_counters.store.slot_reclaimed += n_res + n_lease
            self._slot_changed.notify_all()
        return n_res, n_lease

    def _expire_slots(self) -> None:
        """(lock held) Mark tokens past their deadline expired. An expired reservation's key is
        taken out of the index at once (another writer may store it; waiters stop waiting); its
        bytes, and an expired lease's, stay held until the owner lets go or is reclaimed."""
        now = time.monotonic()
        self._let_go_pins(*self._slots.expire_pins(now))
        rows = self._slots.expire(now)
        if not rows:
            return
        self.metrics_counters.store.slot_expired += len(rows)
        for row in rows:
            e = row.entry
            if row.kind is SlotKind.RESERVATION and self._live(e) and e.state is EntryState.WRITING:
                del self._dram.entries[e.key]
        self._slot_changed.notify_all()

    def expire_slots(self) -> None:
        """Expire tokens past their deadline now (each slot call does this too; the node service
        also calls it from a timer so that expired reservations free their keys). Thread-safe."""
        with self._call(), self._lock:
            self._expire_slots()

    def segment(self) -> SegmentInfo | None:
        """The /dev/shm file holding the DRAM arena (slot offsets are offsets into it), or None
        when the arena is private anonymous memory. Thread-safe."""
        arena = self._dram.arena
        ident = arena.identity()
        if arena.shm_path is None or ident is None:
            return None
        return SegmentInfo(arena.shm_path, self._dram.capacity_bytes, ident[0], ident[1],
                           self.config.dram.alignment_bytes)

    def open_segment_fd(self) -> int:
        """A new read-write descriptor (O_CLOEXEC) of the arena's segment, to pass to a client
        process (the caller closes it); never the descriptor holding the segment's lock. OSError
        when the arena is private. Thread-safe."""
        self._check_open()
        return self._dram.arena.open_segment_fd()

    # -- reads -------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy objects into the caller's writable buffers (DRAM first, else SSD).

        Per key: OK with the object's size, NOT_FOUND, BUFFER_TOO_SMALL with the object's size
        (nothing copied), CORRUPT (served as a miss), INVALID_KEY, IO_ERROR. Raises TypeError,
        before reading anything, when a buffer is read-only or not a buffer. Blocks for SSD reads.
        Objects being read are leased: not evicted or overwritten under the reader (a remove
        meanwhile takes the key at once and frees the bytes when the reader is done).
        """
        check_batch(keys, buffers)
        for i, buf in enumerate(buffers):
            if memoryview(buf).readonly:  # type: ignore[arg-type]
                raise TypeError(f"buffers[{i}] (for key {keys[i]!r}) is read-only; get_into writes into it")
        with self._call(self.metrics_counters.latency.get):
            return self._get_into(keys, buffers)

    def _get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        out: list[ReadResult] = [ReadResult(Status.NOT_FOUND)] * len(keys)
        leased: list[tuple[int, Entry]] = []
        below: list[int] = []
        m = self.metrics_counters
        with self._lock:
            m.store.gets += len(keys)
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = ReadResult(Status.INVALID_KEY)
                    continue
                entry = self._dram.ready(key)
                if entry is None:
                    below.append(i)
                    continue
                if nbytes_of(buffers[i]) < entry.size:
                    out[i] = ReadResult(Status.BUFFER_TOO_SMALL, entry.size)
                    continue
                entry.leases += 1
                leased.append((i, entry))
        arena = self._dram.arena.view
        try:
            for i, entry in leased:
                copy_bytes(byte_view(buffers[i]), arena[entry.offset:entry.offset + entry.size])
                out[i] = ReadResult(Status.OK, entry.size)
        finally:
            with self._lock:
                entries = self._dram.entries
                for _i, entry in leased:
                    if entries.get(entry.key) is entry:
                        entry.leases -= 1
                        self._dram.policy.on_access(entry.key)
                    else:
                        self._unlease(entry)  # removed meanwhile: the last reader frees it
                    m.dram.hits += 1
                    m.dram.bytes_read += entry.size
                m.dram.misses += len(below)
        if below and self._below:
            self._read_below(keys, buffers, below, out)
        return out

    def _read_below(self, keys: Sequence[str], buffers: Sequence[Buffer], idx: list[int],
                    out: list[ReadResult]) -> None:
        """Read the keys at ``idx`` from the tiers below, in order, each tier asked for what the
        ones before it did not serve (no store lock held while a tier reads). A failed read
        (CORRUPT, IO_ERROR) is that tier's miss and the next tier is asked; the answer is the
        first failure when no tier had the object. A tier whose get_into or size_of raises fails
        only the keys it was asked then (IO_ERROR, its failures; see :meth:`_tier_raised`)."""
        m = self.metrics_counters
        with self._lock:  # a key being removed is absent, though its copies below may still be there
            hidden = [i for i in idx if self._removals.hidden(keys[i])]
            idx = [i for i in idx if not self._removals.hidden(keys[i])]
            m.tier(self._below[0].name).misses += len(hidden)
            ticket = self._ticket()
        promote: list[str] = []
        remote: list[tuple[int, Tier]] = []  # hits in a tier of another node: kept as local replicas
        for tier in self._below:
            if not idx:
                break
            tm = m.tier(tier.name)
            try:
                results = tier.get_into([keys[i] for i in idx], [buffers[i] for i in idx])
            except Exception:  # a broken tier: its keys failed, the hits served so far stand
                self._tier_raised(tier, "get_into", len(idx))
                results = [ReadResult(Status.IO_ERROR)] * len(idx)
            short = [i for i, res in zip(idx, results) if res.status is Status.BUFFER_TOO_SMALL]
            sizes: dict[int, int | None] = {}
            sizes_failed = False
            if short:
                try:
                    sizes = dict(zip(short, tier.size_of([keys[i] for i in short])))
                except Exception:
                    self._tier_raised(tier, "size_of", len(short))
                    sizes_failed = True
            missed: list[int] = []
            with self._lock:
                for i, res in zip(idx, results):
                    if res.status is Status.BUFFER_TOO_SMALL and sizes_failed:
                        res = ReadResult(Status.IO_ERROR)
                    elif res.status is Status.BUFFER_TOO_SMALL:  # the backends do not say the size: we do
                        size = sizes.get(i)
                        res = ReadResult(Status.NOT_FOUND) if size is None or self._removals.hidden(keys[i]) \
                            else ReadResult(Status.BUFFER_TOO_SMALL, size)
                    if res.status is not Status.NOT_FOUND or out[i].status is Status.NOT_FOUND:
                        out[i] = res  # a failure in a faster tier is kept over a later miss
                    if res.status is Status.OK:
                        tm.hits += 1
                        tm.bytes_read += res.nbytes
                        if not tier.traits.local_index:
                            remote.append((i, tier))
                            continue
                        if tier is self._backing and keys[i] not in self._dram.entries \
                                and not ticket.evicted(keys[i]):
                            self._known_below.add(keys[i])  # seen stored: a parent admission may ask of
                        if self._hit_below(keys[i]):
                            promote.append(keys[i])
                        continue
                    if res.status in (Status.CORRUPT, Status.IO_ERROR):
                        _count_failure(tm.failures, res.status)
                    tm.misses += 1
                    if res.status in (Status.NOT_FOUND, Status.CORRUPT, Status.IO_ERROR):
                        missed.append(i)
            idx = missed
        if remote and self.config.promotion.enabled:
            self._keep_replicas(keys, buffers, out, remote, ticket)
        if promote and self._started:
            refused = self._promoter.submit(promote)
            if refused:
                with self._lock:
                    m.store.promotion_queue_full += refused

    def _keep_replicas(self, keys: Sequence[str], buffers: Sequence[Buffer], out: list[ReadResult],
                       hits: list[tuple[int, Tier]], ticket: Ticket) -> None:
        """Keep objects just read from another node (into the caller's ``buffers``) as local DRAM
        replicas: a slot reserved as a promotion does (clean victims only), the bytes copied from
        the caller's buffer (no store lock held), committed unless a remove came in between. Best
        effort: no room, a key stored or being removed meanwhile, and the copy is simply not kept."""
        staged: list[tuple[int, Entry, Tier]] = []
        with self._lock:
            if self._closing:
                return
            for i, tier in hits:
                key = keys[i]
                if key in self._dram.entries or ticket.removed(key):
                    continue
                e = self._reserve(key, out[i].nbytes, None, promotion=True)
                if e is not None:
                    staged.append((i, e, tier))
        if not staged:
            return
        filled = self._fill([(e, tier) for _i, e, tier in staged], [buffers[i] for i, _e, _t in staged])
        with self._lock:
            events: list[ResidencyEvent] = []
            for (_i, e, tier), res in zip(staged, filled):
                if not self._live(e) or ticket.removed(e.key) or not res.ok:
                    self._end_reservation(e)
                else:
                    self._commit_promoted(e, tier, ticket, events)
            self._bus.publish(events)
            self._slot_changed.notify_all()

    # -- the fill primitive: objects from the tiers below into DRAM slots ------------------------
    # Stage-in (lease), promotion and pool replicas all bring objects up the same way: locate each
    # below (no store lock held), reserve a WRITING slot under the lock (evicting clean entries
    # only), fill the slots (no lock held), then, under the lock again, keep what is still live and
    # was read whole (``_commit_promoted``, or a stage-in's transient slot) and give the rest up
    # (``_end_reservation``). The first and third steps are these two methods.
    def _locate_below(self, keys: Sequence[str], idx: Iterable[int], tiers: Sequence[Tier]
                      ) -> tuple[dict[int, tuple[int, Tier]], list[tuple[Tier, int]], list[int]]:
        """(no store lock held) Where the keys at ``idx`` lie below DRAM: each one's size in the
        first of ``tiers`` (in order) that has it. Returns (found: index -> (size, tier); misses:
        per tier asked, how many of the keys it was asked it lacked; unanswered: the indices a
        tier whose ``size_of`` raised was asked, not asked further: see :meth:`_tier_raised`)."""
        found: dict[int, tuple[int, Tier]] = {}
        misses: list[tuple[Tier, int]] = []
        todo = list(idx)
        for tier in tiers:
            if not todo:
                break
            try:
                got = tier.size_of([keys[i] for i in todo])
            except Exception:
                self._tier_raised(tier, "size_of", len(todo))
                return found, misses, todo
            for i, size in zip(todo, got):
                if size is not None:
                    found[i] = (size, tier)
            todo = [i for i in todo if i not in found]
            misses.append((tier, len(todo)))
        return found, misses, []

    def _fill(self, slots: Sequence[tuple[Entry, Tier]], copies: Sequence[Buffer] | None = None
              ) -> list[ReadResult]:
        """(no store lock held) Fill WRITING slots (each reserved by the caller, so no one else
        writes it) with their objects: read from each slot's tier, one ``get_into`` per tier in
        tier order, or, with ``copies``, copied from the caller's buffers (bytes it read from that
        tier already). Per slot, in the order of ``slots``: OK when the slot holds the whole object
        (``ReadResult.ok``), else the failure (a tier that raised, or a copy that did, answers
        IO_ERROR, logged). With checksums, each whole slot gets its object's checksum, so a lease
        of it is verified like a committed write."""
        arena = self._dram.arena.view
        out = [ReadResult(Status.IO_ERROR)] * len(slots)
        if copies is not None:
            for n, ((e, tier), src) in enumerate(zip(slots, copies)):
                try:
                    copy_bytes(arena[e.offset:e.offset + e.size], byte_view(src)[:e.size])
                except Exception:
                    logger.exception("copy of %r from the %s tier into its DRAM slot failed", e.key, tier.name)
                    continue
                out[n] = ReadResult(Status.OK, e.size)
        else:
            for tier in dict.fromkeys(t for _e, t in slots):
                batch = [n for n, (_e, t) in enumerate(slots) if t is tier]
                entries = [slots[n][0] for n in batch]
                try:
                    got = tier.get_into([e.key for e in entries], [arena[e.offset:e.offset + e.size] for e in entries])
                except Exception:
                    self._tier_raised(tier, "get_into", len(batch))
                    continue
                for n, e, res in zip(batch, entries, got):
                    # Whole, or of another size than located (a newer copy meanwhile): not this slot's.
                    out[n] = ReadResult(Status.NOT_FOUND) if res.status is Status.OK and res.nbytes != e.size else res
        if self._checksums:
            for (e, _t), res in zip(slots, out):
                if res.ok:
                    e.checksum = object_checksum(e.key, arena[e.offset:e.offset + e.size])
        return out

    def _hit_below(self, key: str) -> bool:
        """(lock held) Count a hit of ``key`` in a local tier below DRAM; True when the promotion
        rule says it now belongs in DRAM (its count is then forgotten). The counts are bounded
        (``_HIT_TABLE_MAX``; the oldest goes first)."""
        hits = self._ssd_hits.get(key, 0) + 1
        if should_promote(hits, self.config.promotion.admission_hits, self.config.promotion.enabled,
                          policy_uses(self._dram.policy, key)):
            self._ssd_hits.pop(key, None)
            return True
        if len(self._ssd_hits) >= _HIT_TABLE_MAX:
            self._ssd_hits.pop(next(iter(self._ssd_hits)))
        self._ssd_hits[key] = hits
        return False

    def _tier_raised(self, tier: Tier, method: str, nkeys: int) -> None:
        """(no lock held; called from an ``except`` block) ``tier.method`` raised for ``nkeys``
        keys, which then answer IO_ERROR (counted by the caller as that tier's failures). Logged
        with its traceback the first time per tier, at debug level after that, so that a tier that
        stays broken does not flood the log."""
        first = tier.name not in self._tiers_raised
        self._tiers_raised.add(tier.name)
        if first:
            logger.exception("tier %s: %s raised for %d keys; they answer IO_ERROR (later failures of "
                             "this tier are logged at debug level)", tier.name, method, nkeys)
        else:
            logger.debug("tier %s: %s raised for %d keys", tier.name, method, nkeys, exc_info=True)

    # -- queries -----------------------------------------------------------------------------------
    def _ask_tier(self, ask: Any, keys: Sequence[str], absent: Any) -> list[Any]:
        """Ask one tier's index about ``keys`` outside the store lock (``ask(keys)`` answers per
        key); a key being removed answers ``absent``. An answer for a key whose visibility changed
        while it was asked (an old copy that an offload landed after a remove, seen just before it
        was deleted) is asked again, and after a few tries taken as ``absent``."""
        out = [absent] * len(keys)
        todo = list(range(len(keys)))
        for attempt in range(_LOOKUP_TRIES):
            if not todo:
                break
            with self._lock:
                ticket = self._ticket()
            answers = ask([keys[i] for i in todo])
            again: list[int] = []
            with self._lock:
                for i, a in zip(todo, answers):
                    out[i] = absent if ticket.removed(keys[i]) else a
                    if ticket.changed(keys[i]):
                        again.append(i)
            todo = again
        return out

    def _ask_below(self, method: str, keys: Sequence[str], absent: Any,
                   tiers: Sequence[Tier] | None = None) -> list[tuple[Any, Tier | None]]:
        """(answer, tier that gave it) per key: ``method`` asked of each tier in order (all of
        ``_below`` unless ``tiers``), each for the keys the ones before it answered ``absent``
        for (see :meth:`_ask_tier`); (``absent``, None) when no tier had the key."""
        out: list[tuple[Any, Tier | None]] = [(absent, None)] * len(keys)
        todo = list(range(len(keys)))
        for tier in self._below if tiers is None else tiers:
            if not todo:
                break
            answers = self._ask_tier(getattr(tier, method), [keys[i] for i in todo], absent)
            for i, a in zip(todo, answers):
                if a != absent:
                    out[i] = (a, tier)
            todo = [i for i in todo if out[i][1] is None]
        return out

    def _on_below(self, keys: Sequence[str], tiers: Sequence[Tier] | None = None) -> list[bool]:
        """Presence in any tier below (or in ``tiers``), outside the store lock; a key being
        removed is absent."""
        return [t is not None for _a, t in self._ask_below("contains", keys, False, tiers)] if keys else []

    def _on_backing(self, keys: Sequence[str]) -> list[bool]:
        """Presence in the backing tier (the offload target), outside the store lock."""
        return self._on_below(keys, [self._backing]) if self._backing is not None else [False] * len(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present in any tier (an object still being written is not)."""
        check_batch(keys)
        with self._call():
            return self._present(keys, count_reserved=False)[0]

    def _present(self, keys: Sequence[str], *, count_reserved: bool) -> tuple[list[bool], int]:
        """(call held, lock not held) Presence per key in any tier, and the store's commit count
        read before DRAM was looked at. ``count_reserved``: an entry being written counts."""
        with self._lock:
            if count_reserved:
                self._expire_slots()  # an expired reservation is a save that will not land
            commits = self._commits
            entries = self._dram.entries
            out = [check_key(k) is None and (e := entries.get(k)) is not None
                   and (count_reserved or e.state is EntryState.READY) for k in keys]
        rest = [i for i, hit in enumerate(out) if not hit and check_key(keys[i]) is None]
        if rest and self._below:
            for i, hit in zip(rest, self._on_below([keys[i] for i in rest])):
                out[i] = hit
        return out, commits

    @staticmethod
    def _leading(hits: Sequence[bool]) -> int:
        n = 0
        for hit in hits:
            if not hit:
                break
            n += 1
        return n

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0) -> int:
        """Number of leading keys present (for prefix-chained keys: the reusable prefix length).

        ``count_reserved``: a key reserved and not yet committed (a save in flight) counts as
        present. ``wait_s`` > 0: when not all keys are present, wait (blocking, up to ``wait_s``)
        for commits until they are, then answer what is present at that moment (fewer at the
        deadline). ``wait_s`` outside [0, ``MAX_PIN_TTL_S``]: ValueError naming it."""
        check_batch(keys)
        check_wait_s("wait_s", wait_s)
        until = time.monotonic() + wait_s
        while True:
            with self._call():
                hits, commits = self._present(keys, count_reserved=count_reserved)
            n = self._leading(hits)
            if n == len(keys) or wait_s <= 0:
                return n
            with self._lock:
                self._check_open()
                left = until - time.monotonic()
                if left <= 0:
                    return n
                if self._commits == commits:  # nothing committed since DRAM was looked at
                    # Waits are woken by commits; the slice is a backstop for copies that land
                    # below without one (another process's writes to a shared directory).
                    self._slot_changed.wait(min(left, _WAIT_SLICE_S))
                    self._check_open()

    def exists_all(self, key_lists: Sequence[Sequence[str]], *, count_reserved: bool = False) -> int:
        """The shortest leading run of present keys over ``key_lists`` (one list per TP rank or
        shard: what every one of them can load), in one call; 0 for no lists. ``count_reserved``
        as in :meth:`exists`. Thread-safe."""
        if isinstance(key_lists, (str, bytes)):
            raise TypeError("key_lists must be a sequence of key lists, not a single str")
        for keys in key_lists:
            check_batch(keys)
        if not key_lists:
            return 0
        flat = [k for keys in key_lists for k in keys]
        with self._call():
            hits, _commits = self._present(flat, count_reserved=count_reserved)
        n, at = None, 0
        for keys in key_lists:
            run = self._leading(hits[at:at + len(keys)])
            n = run if n is None else min(n, run)
            at += len(keys)
        return n or 0

    def tier_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[str | None]:
        """"dram", a lower tier's name ("ssd", "pool") or None for each key (the fastest tier
        holding it). ``local_only``: this node's tiers only (those answering from memory; the
        pool's lookup, a network round trip, is not made)."""
        check_batch(keys)
        with self._call():
            with self._lock:
                out: list[str | None] = [
                    "dram" if check_key(k) is None and self._dram.ready(k) is not None else None for k in keys
                ]
            rest = [i for i, t in enumerate(out) if t is None and check_key(keys[i]) is None]
            if rest and self._below:
                tiers = self._local_tiers() if local_only else None
                for i, (_hit, tier) in zip(rest, self._ask_below("contains", [keys[i] for i in rest], False, tiers)):
                    out[i] = None if tier is None else tier.name
            return out

    def _local_tiers(self) -> list[Tier]:
        """The tiers below DRAM that are this node's own (they answer from memory: not a pool)."""
        return [t for t in self._below if t.traits.local_index]

    def keys(self, prefix: str = "") -> list[str]:
        """Every stored key starting with ``prefix`` (in any tier of this node, each once; not what
        other nodes of a pool hold). A snapshot: O(objects)."""
        with self._call():
            with self._lock:
                out = [k for k, e in self._dram.entries.items()
                       if e.state is EntryState.READY and k.startswith(prefix)]
            seen = set(out)
            for tier in self._local_tiers():
                with self._lock:
                    ticket = self._ticket()
                below = [k for k in tier.keys() if k.startswith(prefix) and k not in seen]
                with self._lock:
                    changed = [k for k in below if ticket.changed(k)]
                    found = [k for k in below if not ticket.removed(k)]
                if changed:  # seen while a removal of them ended: asked again
                    found.extend(k for k, hit in zip(changed, self._on_below(changed, [tier])) if hit)
                out.extend(found)
                seen.update(found)
            return out

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        """Each object's size in bytes, or None when it is stored nowhere."""
        check_batch(keys)
        with self._call():
            with self._lock:
                out: list[int | None] = []
                for k in keys:
                    e = self._dram.ready(k) if check_key(k) is None else None
                    out.append(None if e is None else e.size)
            rest = [i for i, s in enumerate(out) if s is None and check_key(keys[i]) is None]
            if rest and self._below:
                for i, (size, _tier) in zip(rest, self._ask_below("size_of", [keys[i] for i in rest], None)):
                    out[i] = size
            return out

    # -- removal and leases ------------------------------------------------------------------------
    def remove(self, keys: Sequence[str], *, local_only: bool = False) -> list[Status]:
        """Delete objects from every tier; blocks until their SSD copies are deleted. With a pool
        tier, every other node's copy too (through the directory); ``local_only``: this node's
        tiers only (what a peer's transport asks for its part of a pool-wide remove).

        Per key: OK (it was stored and is gone), NOT_FOUND, INVALID_KEY, IO_ERROR (its SSD copy
        could not be deleted, or an offload that was writing it when the remove began has not
        landed it and deleted it again within ``_REMOVE_LANDED_S``: the key reads as absent from
        this store from now on, but the copy may be found again when the directory is reopened;
        or, with a pool tier, a node of the pool did not confirm: the pool retries that itself,
        and the key is not hidden here for it). An OK or NOT_FOUND therefore also means no copy
        is left on disk for a crash to bring back.

        The contract, whatever runs in the background: once ``remove`` returns, no read from any
        thread returns the removed bytes, from any tier, and a ``put`` of the key stores new
        bytes. A promotion reading the SSD copy, an offload or demotion writing it, or a
        promotion queued for it cannot bring it back: each checks at commit whether a remove
        came in between, and an SSD copy that an offload lands after the remove is deleted
        before the key is visible on SSD again. A read that overlaps the remove may return the
        old bytes or a miss. Readers copying the object out of DRAM right now finish with the old
        bytes; its DRAM space is freed when they are done (remove never waits for them).
        """
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        below: list[int] = []
        sizes = [0] * len(keys)
        with self._call():
            with self._lock:
                for i, key in enumerate(keys):
                    if check_key(key) is not None:
                        out[i] = Status.INVALID_KEY
                        continue
                    e = self._dram.entries.get(key)
                    if e is not None:
                        if self._offloading.get(key) is e:
                            self._removals.hold(key)  # the offload deletes the copy it lands
                        self._detach(e)
                        self._slot_changed.notify_all()  # a lease waiting for it to be written
                        out[i] = Status.OK
                        sizes[i] = e.size
                    self._ssd_hits.pop(key, None)
                    self._losses.clear(key)
                    self._known_below.discard(key)
                    if self._below:
                        self._removals.begin(key)
                        below.append(i)
                if not below:
                    self._publish_removed(keys, out, sizes)
            if below:
                # This node's tiers decide whether the key stays hidden here (a copy left on its
                # SSD: deleted again before a new put of the key lands there). A pool's failure
                # (a peer that did not confirm) is in the answer only: the pool retries it itself,
                # and a later put of the key must not remove it pool-wide again.
                below_keys = [keys[i] for i in below]
                statuses = self._delete_below(below_keys, self._local_tiers())
                pooled = [] if local_only else [t for t in self._below if not t.traits.local_index]
                pool_statuses = self._delete_below(below_keys, pooled) if pooled else statuses
                with self._lock:
                    again: list[str] = []
                    for i, st, pst in zip(below, statuses, pool_statuses):
                        deleted = st in (Status.OK, Status.NOT_FOUND)
                        if Status.OK in (st, pst):
                            out[i] = Status.OK
                        if not deleted or pst not in (Status.OK, Status.NOT_FOUND):
                            out[i] = Status.IO_ERROR
                        if self._end_removal(keys[i], deleted):
                            again.append(keys[i])
                    self._offload_again(again)
                    self._wait_deleted(keys, below, out)
                    self._publish_removed(keys, out, sizes)
        return out

    def _publish_removed(self, keys: Sequence[str], out: list[Status], sizes: list[int]) -> None:
        """(lock held) ``removed`` for each key this remove answers OK for, unless a put that raced
        it has stored the key again meanwhile (its ``stored`` came first and still holds)."""
        self._bus.publish([ResidencyEvent("removed", k, ALL_TIERS, sizes[i]) for i, k in enumerate(keys)
                           if out[i] is Status.OK and self._dram.ready(k) is None])

    def _wait_deleted(self, keys: Sequence[str], below: list[int], out: list[Status]) -> None:
        """(lock held) Wait, up to ``_REMOVE_LANDED_S``, until no deletion of these keys' SSD
        copies is owed any more: an offload that was writing one when the remove began lands it
        and deletes it again. Until then a kill would leave the copy on disk, so a key whose
        copy is still owed, or could not be deleted, answers IO_ERROR."""
        deadline = time.monotonic() + _REMOVE_LANDED_S
        waiting = [i for i in below if self._removals.deleting(keys[i])]
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.wait(min(left, _WAIT_SLICE_S))
            waiting = [i for i in waiting if self._removals.deleting(keys[i])]
        for i in waiting:
            logger.warning("remove: the SSD copy of %r that an offload was writing is not deleted yet "
                           "after %.0f s; it stays hidden and is deleted when the write ends",
                           keys[i], _REMOVE_LANDED_S)
        for i in below:
            if self._removals.deleting(keys[i]) or self._removals.stuck(keys[i]):
                out[i] = Status.IO_ERROR

    def _end_removal(self, key: str, deleted: bool) -> bool:
        """(lock held) One owed deletion of ``key``'s SSD copy is done; wakes whoever waits on it
        (a remove, a flush). True when the key is visible on SSD again."""
        visible = self._removals.end(key, deleted)
        self._changed.notify_all()
        return visible

    def _delete_below(self, keys: list[str], tiers: Sequence[Tier] | None = None) -> list[Status]:
        """Delete the copies of ``keys`` in every tier below (or in ``tiers``), store lock not
        held. Per key: OK when some tier deleted a copy and none failed, NOT_FOUND when no tier
        had one, else the first tier's failure (so OK or NOT_FOUND means no copy is left below)."""
        out = [Status.NOT_FOUND] * len(keys)
        for tier in self._below if tiers is None else tiers:
            for i, st in enumerate(self._delete_in(tier, keys)):
                if st is Status.OK and out[i] is Status.NOT_FOUND:
                    out[i] = Status.OK
                elif st not in (Status.OK, Status.NOT_FOUND) and out[i] in (Status.OK, Status.NOT_FOUND):
                    out[i] = st
        return out

    def _delete_in(self, tier: Tier, keys: list[str]) -> list[Status]:
        """Delete copies in ``tier`` (store lock not held). A copy a reader holds (BUSY) is retried
        for up to ``_REMOVE_BUSY_S``; an exception answers IO_ERROR for the keys left."""
        out = [Status.IO_ERROR] * len(keys)
        todo = list(range(len(keys)))
        deadline = time.monotonic() + _REMOVE_BUSY_S
        pause_s = 0.0005
        while todo:
            try:
                statuses = tier.remove([keys[i] for i in todo])
            except Exception:
                if self._closed:
                    raise StoreClosedError("the store was closed during the call") from None
                logger.exception("deleting %d copies in the %s tier failed", len(todo), tier.name)
                break
            for i, st in zip(todo, statuses):
                out[i] = st
            todo = [i for i in todo if out[i] is Status.BUSY]
            if not todo or time.monotonic() > deadline:
                break
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.02)
        for i in todo:
            logger.error("%s copy of %r still busy after %.0f s: hidden until a later remove deletes it",
                         tier.name, keys[i], _REMOVE_BUSY_S)
        return out

    def _queue_again(self, entries: list[Entry], problems: dict[str, str]) -> None:
        """(lock held) Entries a write batch had no room for: back on the offload queue, at its
        head, so that older objects still reach SSD before newer ones. One a full queue refuses
        is not queued: eviction queues it again before DRAM may drop it (eager mode), or a
        demotion pass or a flush writes it (it never counts as a failed write)."""
        self._queue_offload(entries, front=True)
        for e in entries:
            problems[e.key] = "its SSD write did not finish"

    def _offload_again(self, keys: list[str]) -> None:
        """(lock held) Queue again the DRAM objects of ``keys`` whose SSD write waited for the
        deletion of an older copy (eager mode; in watermark mode demotion or flush takes them)."""
        if not keys or not self._started or self.config.offload.policy != "eager":
            return
        self._queue_offload([e for e in map(self._dram.ready, keys)
                             if e is not None and not e.clean and not e.offload_queued])

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0, *, group: int | None = None) -> list[bool]:
        """Lease objects for an in-flight load: DRAM copies are not evicted until ``unpin`` or
        ``ttl_s`` passes (so a crashed caller cannot pin forever). SSD-only objects are queued for
        promotion so the load that follows is served from DRAM. Returns presence per key.
        ``ttl_s`` outside (0, ``MAX_PIN_TTL_S``] (inf, nan, negative): ValueError naming it.

        ``group`` (the node service passes the pinning process): the pins count against that
        share of the arena as slot tokens do (each pinned key's block once, and one token), a key
        past the share answers False (not pinned: that caller's load will find what it finds),
        and :meth:`unpin_all` ends them when the process exits. Without a group, pins are
        nobody's and end by unpin or TTL only."""
        ttl_s = check_ttl_s(ttl_s)
        account = None if group is None else self._slots.account(0, check_group(group))
        present = self.contains(keys)
        deadline = time.monotonic() + ttl_s
        promote: list[str] = []
        with self._lock:
            if account is not None:
                self._expire_slots()
            for i, (key, hit) in enumerate(zip(keys, present)):
                if not hit:
                    continue
                e = self._dram.ready(key)
                if e is None and not self._below:
                    # Evicted since contains() looked (no lower tier holds a copy): answering it
                    # present would report a load nothing protects.
                    present[i] = False
                    continue
                if account is not None:
                    old = self._slots.pin_row(account, key)
                    if old is not None and old.entry is not e:  # a pin of an older copy of the key
                        self._let_go_pins(self._slots.drop_pin(account, key))
                    if not self._slots.pin(account, key, e, 0 if e is None else self._dram.block_bytes(e.size),
                                           deadline):
                        present[i] = False  # past the share: not pinned, so not reported either
                        self.metrics_counters.store.slot_refused += 1
                        continue
                if e is None:
                    promote.append(key)
                    if account is None:
                        self._void_pin(key, 1, deadline)  # its unpin must not release a later pin
                    continue
                e.pins += 1
                e.pin_deadline = max(e.pin_deadline, deadline)
        if promote and self._started and self.config.promotion.enabled:
            self._promoter.submit(promote)
        return present

    @staticmethod
    def _let_go_pins(*rows: PinRow | None) -> None:
        """(lock held) The pins of ``rows`` are over: their entries may be evicted again."""
        for row in rows:
            if row is not None and row.entry is not None:
                row.entry.pins = max(0, row.entry.pins - row.count)

    def unpin_all(self, group: int) -> int:
        """End every pin ``group`` took (:meth:`pin` with it): its process exited. Returns how
        many pinned keys it had. Thread-safe; no I/O."""
        account = self._slots.account(0, check_group(group))
        with self._call(), self._lock:
            rows = self._slots.drop_pins(account)
            self._let_go_pins(*rows)
        return len(rows)

    def unpin(self, keys: Sequence[str], *, group: int | None = None) -> None:
        """Release one lease per key taken by ``pin``. A pin belongs to the entry it was taken on:
        once a remove took that entry (or when the object was only on SSD, so nothing was pinned),
        its unpin releases nothing, even when the key was put again and pinned by someone else.
        ``group``: the caller's own pin of the key when it has one, else another group's (a
        worker's load ends the pin its scheduler took in another process); pins taken without a
        group are not touched then."""
        if group is not None:
            account = self._slots.account(0, check_group(group))
            with self._lock:
                self._check_open()
                for key in keys:
                    row = self._slots.unpin(account, key)
                    if row is not None and row.entry is not None and row.entry.pins > 0:
                        row.entry.pins -= 1
            return
        with self._lock:
            self._check_open()
            now = time.monotonic()
            for key in keys:
                void = self._void_pins.get(key)
                if void is not None:
                    n, expiry = void
                    if n > 1 and expiry >= now:
                        self._void_pins[key] = (n - 1, expiry)
                    else:
                        del self._void_pins[key]
                    if expiry >= now:
                        continue
                e = self._dram.entries.get(key)
                if e is not None and e.pins > 0:
                    e.pins -= 1

    def _void_pin(self, key: str, n: int, expiry: float) -> None:
        """(lock held) ``n`` pins of ``key`` that pin no live entry, until ``expiry`` (their TTL)."""
        now = time.monotonic()
        if len(self._void_pins) >= _HIT_TABLE_MAX:  # bounded: expired ones go first, then the oldest
            for k in [k for k, (_n, t) in self._void_pins.items() if t < now] or [next(iter(self._void_pins))]:
                del self._void_pins[k]
        old_n, old_expiry = self._void_pins.get(key, (0, now))
        self._void_pins[key] = (old_n + n, max(old_expiry, expiry))

    # -- background movement -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Persist what is in DRAM; True only when every object put before the call that the SSD
        admission policy accepts is on SSD. :meth:`flush_report` says which are not, and why."""
        return self.flush_report(timeout_s).ok

    def flush_report(self, timeout_s: float | None = None) -> FlushReport:
        """Write to SSD every object put before the call that is not there yet; blocking.

        It first lets the offloads queued before the call finish and, in watermark mode, one
        demotion pass run (down to the low mark, as DRAM use demands), then writes whatever is
        still not on SSD from the calling thread: in watermark mode too, everything, not only
        down to the low mark (those objects stay in DRAM, now clean). An object the background
        is writing meanwhile is waited for, not written twice. A failed write is retried (up to
        ``MAX_OFFLOAD_ATTEMPTS`` failed writes per object). Promotions queued before the call
        are waited for too. Work queued after the call never is, so steady traffic cannot hold a
        flush up. Works whether or not ``start()`` was called.

        The report is ``ok`` when every object put before the call that the admission policy
        accepts is on SSD. Otherwise ``unpersisted`` names each one that is not, with why: its
        SSD write failed (the status), the flush timed out, an older copy of the key is still
        being deleted, or it was evicted from DRAM before it reached SSD (eager mode when the SSD
        tier falls behind; such a loss is reported by every flush that began after the object was
        put, until the key is put again or removed; past a bound of 65536 remembered losses the
        oldest are forgotten and ``lost_untracked`` counts them, in the next flush that covers
        them only). Not failures: objects removed since, objects admission declines (counted in
        ``declined``), and SSD copies the SSD tier later evicts by its own capacity policy.
        Without an SSD tier the report is always ``ok``. Thread-safe; objects put while it runs
        are not waited for.
        """
        with self._call():
            return self._flush(timeout_s)

    def _flush(self, timeout_s: float | None) -> FlushReport:
        if self._backing is None:
            return FlushReport()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._lock:
            snapshot = [e for e in self._dram.entries.values() if e.state is EntryState.READY]
            put_seq = self._put_seq
        promotions, offloads = self._promoter.mark(), self._offloader.mark()
        # Queued work first, so that little is written twice; but only work queued before the
        # call (traffic after it must not starve the flush): the offloads queued by then and, in
        # watermark mode, one demotion pass. What is left of the snapshot is written from here (an
        # object the worker is writing meanwhile is waited for, not written twice).
        if self._started:
            passes = self._offloader.kick() if self.config.offload.policy == "watermark" else 0
            self._offloader.wait_for(items=offloads, passes=passes, timeout_s=left())
        problems: dict[str, str] = {}
        timed_out = False
        failed: dict[str, int] = {}  # writes of an object that failed in this flush
        stalls = 0  # rounds in which nothing new reached SSD
        before = None
        while True:
            pending = [e for e in self._flush_pending(snapshot) if failed.get(e.key, 0) < MAX_OFFLOAD_ATTEMPTS]
            if not pending or stalls >= MAX_OFFLOAD_ATTEMPTS:
                break
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                break
            if before is not None and len(pending) >= before:
                stalls += 1
            before = len(pending)
            written = self._write_now(pending, deadline)
            problems.update(written)
            timed_out = not self._wait_written(snapshot, deadline)
            for key, why in written.items():
                if why.startswith(_WRITE_FAILED):
                    failed[key] = failed.get(key, 0) + 1
        if self._started:
            self._promoter.wait_for(items=promotions, timeout_s=left())
        with self._lock:
            unpersisted: dict[str, str] = {}
            declined = 0
            for e in snapshot:
                if not self._live(e):
                    continue  # removed since (a loss from eviction is in the ledger)
                if e.declined:
                    declined += 1
                elif not e.persisted and not e.replica:  # a replica's copy is another node's
                    unpersisted[e.key] = problems.get(e.key) or ("the flush timed out before it was written"
                                                                 if timed_out else "its SSD write did not finish")
            for key, why in self._losses.items(put_seq):
                unpersisted.setdefault(key, why)
            return FlushReport(unpersisted, declined, self._losses.take_forgotten(put_seq))

    def _flush_pending(self, snapshot: list[Entry]) -> list[Entry]:
        """Entries of ``snapshot`` that still need an SSD write: dirty ones, persisted ones whose
        SSD copy the SSD tier has evicted since, and declined ones that admission now accepts."""
        with self._lock:
            live = [e for e in snapshot if self._live(e)]
            persisted = [e.key for e in live if e.persisted]
            parents = sorted({e.parent for e in live if e.declined and e.parent is not None
                              and e.parent not in self._dram.entries})
        present = {k for k, hit in zip(persisted, self._on_backing(persisted)) if hit} if persisted else set()
        parents_on_ssd = {p for p, hit in zip(parents, self._on_backing(parents)) if hit} if parents else set()
        with self._lock:
            for e in live:
                if not self._live(e) or e.key in self._offloading:
                    continue
                if e.persisted and e.key not in present:
                    e.persisted = False  # the SSD tier dropped its copy: write it again
                if e.declined and self._admitted(e, e.parent in parents_on_ssd):
                    e.declined = False
            return [e for e in live if self._live(e) and not e.clean]

    def _write_now(self, pending: list[Entry], deadline: float | None) -> dict[str, str]:
        """Write ``pending`` to SSD from the calling thread, in offload-sized batches; returns why
        each object that was not written was not."""
        problems: dict[str, str] = {}
        batch_max = max(1, self.config.ssd.bucket_max_keys if self.config.ssd else 256)
        chunk: list[str] = []
        weight = 0
        for i, e in enumerate(pending):
            chunk.append(e.key)
            weight += e.size
            nxt = pending[i + 1].size if i + 1 < len(pending) else 0
            if len(chunk) >= batch_max or weight + nxt > self._write_batch_bytes() or i == len(pending) - 1:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                problems.update(self._offload_batch(chunk, deadline=deadline))
                chunk, weight = [], 0
        return problems

    def _wait_written(self, snapshot: list[Entry], deadline: float | None) -> bool:
        """Wait until no entry of ``snapshot`` has an SSD write in flight or waits for the deletion
        of an older SSD copy of its key; False on timeout."""
        def busy(e: Entry) -> bool:
            return self._offloading.get(e.key) is e or (self._live(e) and self._removals.deleting(e.key))

        with self._lock:
            waiting = [e for e in snapshot if busy(e)]
            while waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(_WAIT_SLICE_S if left is None else min(left, _WAIT_SLICE_S))
                waiting = [e for e in waiting if busy(e)]
        return True

    def _write_batch_bytes(self) -> int:
        """Bytes one SSD write may lease: ``offload.batch_bytes``, but never more than half of DRAM,
        so that slow writes in flight never leave a put without an object it may evict, shared by
        the ``offload.write_threads`` writes the worker keeps in flight (so they overlap). The
        half holds for all writes together (the worker's and every flushing caller's): see
        ``_writing_bytes`` and :meth:`_write_room_bytes`."""
        off = self.config.offload
        return max(1, min(off.batch_bytes, self._write_room_bytes() // off.write_threads))

    def _write_room_bytes(self) -> int:
        """DRAM bytes that all SSD writes in flight together may lease (one object always may)."""
        return max(1, self._dram.capacity_bytes // 2)

    def _queued_size(self, key: str) -> int:
        e = self._dram.entries.get(key)  # racy read of a dict is safe; only used to size batches
        return 0 if e is None else e.size

    def _over_high_watermark(self) -> bool:
        off = self.config.offload
        return demotion_bytes(self._dram.used_bytes, self._dram.capacity_bytes,
                              off.high_watermark, off.low_watermark) > 0

    def _offload_batch(self, keys: list[str], *, demote: bool = False, deadline: float | None = None
                       ) -> dict[str, str]:
        """Copy DRAM objects to SSD straight from the arena (worker thread, or a flushing caller);
        with ``demote``, free them from DRAM afterwards (watermark mode). Waits (until
        ``deadline``) while other SSD writes hold all the room they may lease. Returns why each
        object that is still not on SSD was not written."""
        backing = self._backing
        assert backing is not None
        m = self.metrics_counters
        problems: dict[str, str] = {}
        with self._lock:
            if self._closed:
                return problems
            todo: list[Entry] = []
            stuck: list[Entry] = []
            for key in keys:
                e = self._dram.ready(key)
                if e is None:
                    continue
                e.offload_queued = False
                if e.clean or key in self._offloading:
                    continue
                if self._removals.stuck(key):  # an earlier deletion failed: try it again first
                    self._removals.hold(key)  # (still hidden, and no one else retries it meanwhile)
                    stuck.append(e)
                elif self._removals.hidden(key):  # queued again when the deletion ends
                    problems[key] = "an older SSD copy of the key is still being deleted"
                else:
                    todo.append(e)
        if stuck:
            statuses = self._delete_below([e.key for e in stuck], self._local_tiers())  # stuck: a local copy
            with self._lock:
                for e, st in zip(stuck, statuses):
                    deleted = st in (Status.OK, Status.NOT_FOUND)
                    if self._end_removal(e.key, deleted):
                        todo.append(e)
                    elif not deleted:
                        problems[e.key] = f"an older SSD copy of the key could not be deleted ({st.name})"
                    else:
                        problems[e.key] = "an older SSD copy of the key is still being deleted"
        with self._lock:
            parents = {e.parent for e in todo if e.parent is not None and e.parent not in self._dram.entries}
        # Asked outside the store lock (the SSD index has its own); a parent that leaves SSD meanwhile
        # only costs one write that admission would have skipped.
        parents_on_ssd = {p for p, hit in zip(parents, self._on_backing(list(parents))) if hit} if parents else set()
        later: list[Entry] = []  # past the batch's byte cap: queued again
        with self._lock:
            def writable(e: Entry) -> bool:
                return self._live(e) and not e.clean and e.key not in self._offloading \
                    and not self._removals.hidden(e.key)

            # All SSD writes together lease at most half of DRAM (see _write_batch_bytes): wait for
            # room for the first object while other writes hold it (they end on their own).
            half = self._write_room_bytes()
            while True:
                first = next((e for e in todo if writable(e)), None)
                if first is None or not self._writing_bytes or self._writing_bytes + first.size <= half:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or self._offloader.stopping or (left is not None and left <= 0):
                    break  # no room after all: queued again below
                self._changed.wait(_WAIT_SLICE_S if left is None else min(left, _WAIT_SLICE_S))
            batch: list[Entry] = []
            dropped: list[ResidencyEvent] = []
            # Evictions the SSD tier reports from here on void this batch's OKs (EvictionClock).
            ticket = self._ticket()
            cap, leased = min(self._write_batch_bytes(), half - self._writing_bytes), 0
            for e in todo:
                if not writable(e):
                    continue
                if (batch or self._writing_bytes) and leased + e.size > cap:
                    later.append(e)
                    continue
                if not self._admitted(e, e.parent in parents_on_ssd):
                    e.declined = True  # asked again when DRAM wants to evict it
                    m.store.offload_declined += 1
                    if demote and e.leases == 0 and e.pins == 0:
                        self._dropped_from_dram(e, dropped)
                        self._dram.drop(e.key)
                        m.dram.evictions += 1
                    continue
                e.leases += 1
                leased += e.size
                self._offloading[e.key] = e
                batch.append(e)
            self._writing_bytes += leased
            self._queue_again(later, problems)
            self._bus.publish(dropped)
            if dropped:
                self._room.notify_all()
        if not batch:
            return problems
        arena = self._dram.arena.view
        try:
            statuses = backing.put([e.key for e in batch], [arena[e.offset:e.offset + e.size] for e in batch])
        except Exception:
            statuses = [Status.IO_ERROR] * len(batch)
            logger.exception("offload of %d objects failed", len(batch))
        landed_after_remove: list[str] = []
        with self._lock:
            self._writing_bytes -= leased
            events: list[ResidencyEvent] = []
            for e, st in zip(batch, statuses):
                del self._offloading[e.key]
                self._unlease(e)
                if not self._live(e):  # removed while it was written: delete what may have landed
                    landed_after_remove.append(e.key)
                    continue
                if st.ok and ticket.evicted(e.key):
                    # The SSD tier evicted the copy after it landed (and the report came first):
                    # still dirty, written back before DRAM may drop it.
                    self._lost_below(e)
                    problems[e.key] = "its SSD copy was evicted by the SSD tier as it landed"
                elif st.ok:
                    e.persisted = True
                    e.offload_failures = 0
                    m.dram.offloads += 1
                    m.tier(backing.name).bytes_written += e.size if st is Status.OK else 0
                    events.append(ResidencyEvent("moved", e.key, backing.name, e.size, src_tier="dram"))
                    if demote and e.leases == 0 and e.pins == 0:
                        self._dropped_from_dram(e, events)
                        self._dram.drop(e.key)
                        m.dram.evictions += 1
                else:
                    e.offload_failures += 1  # retried when DRAM needs the room (see _reserve)
                    _count_failure(m.tier(backing.name).failures, st)
                    problems[e.key] = f"{_WRITE_FAILED} {st.name}"
            self._bus.publish(events)
            self._changed.notify_all()
            self._room.notify_all()  # clean now (or dropped): puts waiting for room look again
        if landed_after_remove:
            statuses = self._delete_below(landed_after_remove, [backing])
            with self._lock:
                again = [k for k, st in zip(landed_after_remove, statuses)
                         if self._end_removal(k, st in (Status.OK, Status.NOT_FOUND))]
                self._offload_again(again)
        return problems

    def _watermark_tick(self) -> None:
        """Worker thread, idle: in watermark mode move the coldest objects down to the low mark."""
        off = self.config.offload
        with self._lock:
            if self._closed:
                return
            need = demotion_bytes(self._dram.used_bytes, self._dram.capacity_bytes,
                                  off.high_watermark, off.low_watermark)
            if need <= 0:
                return
            now = time.monotonic()
            victims = self._dram.policy.victims(
                need, lambda k: (e := self._dram.entries.get(k)) is not None and e.evictable(now))
            entries = self._dram.entries
            # From memory only: the SSD tier's eviction reports keep ``persisted`` honest.
            clean, dirty = demotion_split([self._victim_facts(entries[k], now) for k in victims])
            for k in dirty:  # a declined one that admission now accepts is written, as in _reserve
                entries[k].declined = False
            events: list[ResidencyEvent] = []
            for k in clean:  # already on SSD (or not wanted there): nothing to write, just free DRAM
                self._dropped_from_dram(entries[k], events)
                self._dram.drop(k)
                self.metrics_counters.dram.evictions += 1
            self._bus.publish(events)
            if clean:
                self._room.notify_all()
        cap = self._write_batch_bytes()
        chunk: list[str] = []
        weight = 0
        for k in dirty:
            size = self._queued_size(k)
            if chunk and weight + size > cap:
                self._offload_batch(chunk, demote=True)
                chunk, weight = [], 0
            chunk.append(k)
            weight += size
        if chunk:
            self._offload_batch(chunk, demote=True)

    def _commit_promoted(self, e: Entry, tier: Tier, ticket: Ticket, events: list[ResidencyEvent]) -> None:
        """(store lock held) Make ``e``, just read from ``tier`` into its DRAM slot, the DRAM copy:
        clean when read from the backing tier, unless the backing tier evicted the copy since the
        read was planned (``ticket``); counted as a promotion and published."""
        e.persisted = tier is self._backing
        e.replica = not tier.traits.local_index  # read from another node: a local replica of it
        if e.persisted and ticket.evicted(e.key):
            self._lost_below(e)
        self._dram.commit(e)
        self._known_below.discard(e.key)
        self.metrics_counters.dram.promotions += 1
        self.metrics_counters.dram.bytes_written += e.size
        events.append(ResidencyEvent("moved", e.key, "dram", e.size, src_tier=tier.name))

    def _promote_batch(self, keys: list[str]) -> None:
        """Worker thread: copy hot SSD objects back into DRAM, evicting only clean objects.

        The SSD lookup and the read run outside the lock, so each key is checked again at each
        step: skipped when a remove of it came after the lookup, dropped when a remove took its
        reservation during the read (a removed object never comes back this way). Each object is
        read from the fastest tier below that answered its size; it is clean in DRAM only when
        that is the backing tier."""
        m = self.metrics_counters
        with self._lock:
            if self._closed:
                return
            looked = self._ticket()
            keys = [k for k in keys if not self._removals.hidden(k) and k not in self._dram.entries]
        found, _misses, unanswered = self._locate_below(keys, range(len(keys)), self._below)
        reserved: list[tuple[Entry, Tier]] = []
        with self._lock:
            if self._closed:
                return
            m.store.promotions_skipped += len(unanswered)
            ticket = self._ticket()  # evictions from here on void the read's cleanliness
            for i, (size, tier) in sorted(found.items()):
                key = keys[i]
                if key in self._dram.entries or looked.removed(key):
                    continue
                e = self._reserve(key, size, None, promotion=True)
                if e is None:
                    m.store.promotions_skipped += 1
                    m.dram.failures.capacity += 1
                    continue
                reserved.append((e, tier))
        if not reserved:
            return
        filled = self._fill(reserved)
        with self._lock:
            events: list[ResidencyEvent] = []
            for (e, tier), res in zip(reserved, filled):
                if self._live(e) and res.ok:
                    self._commit_promoted(e, tier, ticket, events)
                else:  # removed while it was read, or the read failed
                    self._end_reservation(e)
                    m.store.promotions_skipped += 1
                    if res.status in (Status.CORRUPT, Status.IO_ERROR):
                        _count_failure(m.tier(tier.name).failures, res.status)
            self._bus.publish(events)
            self._slot_changed.notify_all()  # lease(wait_pending_s) waiters: promoted or dropped

    # -- observability -----------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """A typed copy of every counter, with the gauges as they are now (capacity, usage and
        objects per tier, queue depths), per tier by name. Thread-safe; takes the store lock
        briefly, and asks the tiers below for their gauges outside it."""
        with self._call():
            return self._stats()

    def _stats(self) -> StoreStats:
        below = {t.name: t.gauges() for t in self._below}
        with self._lock:
            gauges = {"dram": {"used_bytes": self._dram.used_bytes, "capacity_bytes": self._dram.capacity_bytes,
                               "objects": len(self._dram.entries)}}
            queues = QueueGauges(offload=self._offloader.depth, promotion=self._promoter.depth)
            stats = self.metrics_counters.snapshot(gauges, queues)
            stats.store.events_dropped = self._bus.dropped
            self._expire_slots()
            t = self._slots
            stats.store.arena_double_frees = self._dram.double_frees
            stats.slots = SlotGauges(reservations=t.count(SlotKind.RESERVATION), leases=t.count(SlotKind.LEASE),
                                     owners=t.owner_count, held_bytes=t.held_bytes,
                                     expired_held_bytes=t.expired_held_bytes, pins=t.pin_count,
                                     pinned_bytes=t.pinned_bytes)
        reported = stats.tiers
        for name, g in below.items():
            # A tier below evicts on its own (capacity): its evictions are the tier's own count.
            ts = reported.get(name)
            if ts is None:  # a tier StoreStats has no field for yet (see StoreStats)
                continue
            ts.used_bytes, ts.capacity_bytes, ts.objects, ts.evictions = (
                g.used_bytes, g.capacity_bytes, g.objects, g.evictions)
            if g.failures is not None:
                ts.failures = msgspec.structs.replace(g.failures)
            if g.hits is not None:
                ts.hits = g.hits
            if g.bytes_read is not None:
                ts.bytes_read = g.bytes_read
        stats.queues.pool_remove = sum(g.owed_removes for g in below.values())
        return stats

    def metrics(self) -> dict[str, Any]:
        """:meth:`stats` as a plain nested dict (a copy): one entry per tier name ("dram", "ssd",
        ...) beside "store", "queues" and "latency", plus each lower tier's extra counts (the SSD
        backend's ``corrupt_reads``, ``recovered_objects``) for logs and tests."""
        with self._call():
            stats = self._stats()
            extras = {t.name: t.extra_stats() for t in self._below}
        snap: dict[str, Any] = msgspec.to_builtins(stats)
        for name, extra in extras.items():
            if name in snap:
                snap[name].update(extra)
        return snap
