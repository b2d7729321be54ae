"""The client API engines use: prefix lookup, asynchronous batched save/load, per-key results, leases.

Engine connectors (vLLM's scheduler and worker halves, SGLang's HiCache thread) hold one
:class:`KVClient` each. It owns a small bounded pool of I/O threads (started by ``start()``, stopped by
``close()``; nothing runs before ``start()``) that copies bytes between the engine's staging buffers
and the store. Every method is thread-safe.

Outcomes are data: ``save`` resolves to one :class:`store_backend.types.Status` per key, ``load`` to
one :class:`store_backend.types.ReadResult` per key; a problem with one key never raises. Buffers
stay owned by the caller, who must keep them alive (and, for loads, not read them) until the returned
future is done.

Saves in flight count as present: ``lookup`` reports a key whose save was submitted but has not
landed yet, and ``load`` of such a key first waits for that save. A request that arrives right after
the one that produced its prefix therefore reuses it instead of racing the asynchronous save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec

from mooncake_connector.metrics import ConnectorCounters, ConnectorFailures, ConnectorLatency, ConnectorStats, copy_stats
from store_backend.api import KVStore  # the store interface; re-exported here for callers
from store_backend.threads import Deadline, shutdown_pool
from store_backend.slots import Reservation, SlotLease
from store_backend.types import Buffer, ReadResult, Status

logger = logging.getLogger(__name__)


# A lease refused for want of room, not for the object: the object is read instead (see KVClient.lease).
_NO_ROOM = frozenset({Status.NO_SPACE, Status.TOO_LARGE})


class CopiedLease(SlotLease):
    """What :meth:`KVClient.lease` hands out for an object the store could not lease for want of
    room (NO_SPACE: no slot could be made for an object on SSD only, or this process's share of the
    arena is held; TOO_LARGE: larger than that share): the object read with ``get_into`` into a
    private buffer of this process. ``layer``/``view`` read that buffer; its bytes are stable by
    construction, so :meth:`KVClient.release` answers True for it without asking the store."""

    __slots__ = ()


class ClientClosedError(RuntimeError):
    """A save or load submitted to a client that is not started, or already closed."""


class _LoadTally:
    """How one submitted load is counted: by its I/O thread as it finishes, or as timed out by a
    caller that gave up on it first (:meth:`KVClient.abandon_load`); guarded by the client's lock."""

    __slots__ = ("abandoned", "counted")

    def __init__(self) -> None:
        self.abandoned = False
        self.counted = False


_TALLY = "_mooncake_load_tally"  # the attribute of a load's Future holding its _LoadTally


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class KVClient:
    """Batched, asynchronous access to a :class:`KVStore` for one engine connector."""

    def __init__(self, store: KVStore, *, io_workers: int = 2, max_pending_batches: int = 64,
                 lease_ttl_s: float = 60.0, name: str = "kv-client") -> None:
        if io_workers <= 0 or max_pending_batches <= 0:
            raise ValueError("io_workers and max_pending_batches must be > 0")
        self.store = store
        self.lease_ttl_s = lease_ttl_s
        self._io_workers = io_workers
        self._name = name
        self._slots = threading.BoundedSemaphore(max_pending_batches)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}  # key -> its save in flight
        self.counters = ConnectorCounters()
        self.latency = ConnectorLatency()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> KVClient:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._io_workers, thread_name_prefix=self._name)
        return self

    def close(self, timeout_s: float | None = None) -> int:
        """Finish every submitted save and load, then stop the threads (blocking; at most
        ``timeout_s`` when given). Returns how many I/O threads were still running then (a store
        call that hangs): each is logged at WARNING by name and left behind, never waited for
        again; the owner counts them in ``thread_join_timeouts``."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return 0
        return shutdown_pool(pool, Deadline(timeout_s), owner=self._name)

    def __enter__(self) -> KVClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[..., Any], *args: Any, block: bool,
                timeout_s: float | None = None) -> Future | None:
        """Queue ``fn`` on an I/O thread (``self._lock`` may be held by the caller). With ``block``,
        waits for a free batch slot (at most ``timeout_s`` when given); None when none came."""
        if block and timeout_s is not None:
            got = self._slots.acquire(timeout=timeout_s)
        else:
            got = self._slots.acquire(blocking=block)
        if not got:
            return None
        pool = self._pool
        if pool is None:
            self._slots.release()
            raise ClientClosedError(f"{self._name} is not started (or closed)")
        fut = pool.submit(fn, *args)
        fut.add_done_callback(lambda _f: self._slots.release())
        return fut

    # -- lookup ------------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys present in the store or being saved (blocking; cheap for the
        embedded store)."""
        t0 = time.perf_counter()
        n = 0
        while n < len(keys):
            if keys[n] in self._pending:  # racy read of a dict: a save just landing is in the store
                n += 1
                continue
            found = self.store.exists(keys[n:])
            if found == 0:
                break
            n += found
        with self._lock:
            c = self.counters
            c.lookups += 1
            c.lookup_keys += len(keys)
            c.lookup_hits += n
            self.latency.lookup.observe(time.perf_counter() - t0)
        return n

    def lookup_async(self, keys: Sequence[str]) -> Future:
        """``lookup`` on an I/O thread: a future of the number of leading keys present."""
        return self.lookup_all_async([keys])

    def lookup_all(self, key_lists: Sequence[Sequence[str]]) -> int:
        """Leading positions present in every list (one list per KV shard of the same chunks)."""
        return min((self.lookup(keys) for keys in key_lists), default=0)

    def lookup_all_async(self, key_lists: Sequence[Sequence[str]]) -> Future:
        """``lookup_all`` on an I/O thread (never blocks the caller for the lookup itself)."""
        fut = self._submit(self.lookup_all, [list(k) for k in key_lists], block=True)
        assert fut is not None
        return fut

    def exists(self, keys: Sequence[str]) -> int:
        """``lookup`` under the store's name, so a client can stand in for a store (lookup service)."""
        return self.lookup(keys)

    def tier_of(self, keys: Sequence[str]) -> list[str | None]:
        """The fastest tier holding each key ("dram", "ssd", None); a key whose save is in flight
        answers "dram", where the save lands (blocking; cheap for the embedded store)."""
        out = list(self.store.tier_of(keys))
        return ["dram" if t is None and k in self._pending else t for k, t in zip(keys, out)]

    # -- leases ------------------------------------------------------------------------------------
    def pin(self, keys: Sequence[str], ttl_s: float | None = None) -> list[bool]:
        """Lease objects for a coming load (see ``TieredStore.pin``); presence per key."""
        return self.store.pin(keys, ttl_s=self.lease_ttl_s if ttl_s is None else ttl_s) if keys else []

    def unpin(self, keys: Sequence[str]) -> None:
        if keys:
            self.store.unpin(keys)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Delete objects from the store (blocking; one status per key, see ``TieredStore.remove``).

        For a copy that read back CORRUPT: objects are immutable, so a put of the same key answers
        EXISTS and keeps the damaged bytes until the copy is removed."""
        return list(self.store.remove(keys)) if keys else []

    # -- save --------------------------------------------------------------------------------------
    def save(self, keys: Sequence[str], buffers: Sequence[Buffer],
             parents: Sequence[str | None] | None = None, *, after: Callable[[], None] | None = None) -> Future:
        """Store objects from the caller's buffers on an I/O thread; never blocks the caller.

        The future resolves to one Status per key (OK, EXISTS, NO_SPACE, ...). When too many batches
        are already in flight the batch is dropped at once (every key NO_SPACE, ``saves_dropped``
        counted): a dropped save is only a future cache miss, while a blocked forward is lost time.
        ``after`` runs on the I/O thread before the put (e.g. wait for the device copies that fill
        the buffers).
        """
        keys = list(keys)
        if not keys:
            return _done([])
        with self._lock:  # registered before the put can run, so lookups never miss it
            fut = self._submit(self._save, keys, list(buffers), parents, time.perf_counter(), after, block=False)
            if fut is None:
                self.counters.saves_dropped += len(keys)
                self.counters.failures.capacity += len(keys)
                return _done([Status.NO_SPACE] * len(keys))
            for k in keys:
                self._pending[k] = fut
        fut.add_done_callback(lambda f, ks=keys: self._landed(ks, f))
        return fut

    def _landed(self, keys: list[str], fut: Future) -> None:
        with self._lock:
            for k in keys:
                if self._pending.get(k) is fut:
                    del self._pending[k]

    def _save(self, keys: list[str], buffers: list[Buffer], parents: Sequence[str | None] | None,
              submitted: float, after: Callable[[], None] | None = None) -> list[Status]:
        try:
            if after is not None:
                after()
            statuses = self.store.put(keys, buffers, parents)
        except Exception:
            logger.exception("save of %d objects failed", len(keys))
            statuses = [Status.IO_ERROR] * len(keys)
        with self._lock:
            c = self.counters
            c.save_batches += 1
            for buf, st in zip(buffers, statuses):
                if st is Status.OK:
                    c.saved_objects += 1
                    c.saved_bytes += memoryview(buf).nbytes
                elif st is Status.EXISTS:
                    c.save_exists += 1
                else:
                    c.save_failed += 1
                    _count_failure(c.failures, st)
            self.latency.save.observe(time.perf_counter() - submitted)
        return statuses

    # -- load --------------------------------------------------------------------------------------
    def load(self, keys: Sequence[str], buffers: Sequence[Buffer], *, sizes: Sequence[int] | None = None,
             unpin_after: bool = False, wait_saves_s: float = 30.0, timeout_s: float | None = None) -> Future:
        """Copy objects into the caller's writable buffers on an I/O thread.

        The future resolves to one ReadResult per key. With ``sizes``, an object of another size is
        reported CORRUPT (a stored object that does not match the reader's layout is never used).
        ``unpin_after`` releases leases taken with ``pin`` once the bytes are copied (or once the
        load gave up). Blocks while a save of one of these keys is still in flight (at most
        ``wait_saves_s``), and while the client already has its maximum of batches in flight.

        ``timeout_s`` bounds all of that blocking together (a caller on an engine's forward thread
        passes its load timeout): when no batch slot came free in time (a stuck store holds them
        all) the load is not submitted and resolves at once to IO_ERROR for every key, which the
        caller treats as any failed load (the engine recomputes). Without it the wait for a slot
        is unbounded.
        """
        keys = list(keys)
        if not keys:
            return _done([])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.wait_for_saves(keys, wait_saves_s if timeout_s is None else min(wait_saves_s, timeout_s))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        tally = _LoadTally()
        fut = self._submit(self._load, keys, list(buffers), sizes, unpin_after, time.perf_counter(), tally,
                           block=True, timeout_s=left)
        if fut is None:
            logger.warning("load of %d objects not started: no I/O slot free within %.1f s", len(keys), timeout_s)
            if unpin_after:
                self.unpin(keys)
            with self._lock:
                self.counters.load_failed += len(keys)
                self.counters.failures.timeout += len(keys)
            return _done([ReadResult(Status.IO_ERROR)] * len(keys))
        setattr(fut, _TALLY, tally)
        return fut

    def abandon_load(self, fut: Future, count: int) -> None:
        """The caller stopped waiting for ``fut`` (a :meth:`load` of ``count`` objects) and will not
        use its bytes: they count as failed loads of kind ``timeout``, never as loaded, however the
        load ends. A load that had already finished (it raced the caller's timeout), or that never
        started (already counted as timed out), keeps its counts. Thread-safe; never blocks."""
        tally = getattr(fut, _TALLY, None)
        with self._lock:
            if tally is None or tally.counted:
                return
            tally.abandoned = True
            self.counters.load_failed += count
            self.counters.failures.timeout += count

    def wait_for_saves(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until no save of ``keys`` is in flight (False if ``timeout_s`` passed first)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            waits = {id(f): f for k in keys if (f := self._pending.get(k)) is not None}
        for fut in waits.values():
            try:
                left = deadline - time.monotonic()
                fut.result(timeout=None if left == float("inf") else max(0.0, left))
            except FutureTimeout:
                return False
        return True

    def _load(self, keys: list[str], buffers: list[Buffer], sizes: Sequence[int] | None,
              unpin_after: bool, submitted: float, tally: _LoadTally) -> list[ReadResult]:
        try:
            results = self.store.get_into(keys, buffers)
        except Exception:
            logger.exception("load of %d objects failed", len(keys))
            results = [ReadResult(Status.IO_ERROR)] * len(keys)
        finally:
            if unpin_after:
                self.unpin(keys)
        if sizes is not None:
            results = [r if not r.ok or r.nbytes == want else ReadResult(Status.CORRUPT, r.nbytes)
                       for r, want in zip(results, sizes)]
        with self._lock:
            c = self.counters
            c.load_batches += 1
            tally.counted = True
            for r in results if not tally.abandoned else ():  # abandoned: counted as timed out
                if r.ok:
                    c.loaded_objects += 1
                    c.loaded_bytes += r.nbytes
                else:
                    c.load_failed += 1
                    _count_failure(c.failures, r.status)
            self.latency.load.observe(time.perf_counter() - submitted)
        return results

    # -- slots (one copy: the caller copies straight into or out of the store's memory) ------------
    def lease(self, keys: Sequence[str], *, ttl_s: float, wait_pending_s: float = 0.0, size: int | None = None,
              unpin_after: bool = False) -> list[SlotLease]:
        """Lease objects' slots for reading in place (``KVStore.lease``). Blocking: waits for this
        client's saves of these keys still in flight (at most ``wait_pending_s``), then one store
        call. A lease of an object that is not ``size`` bytes is given back at once and answered
        CORRUPT (a stored object that does not match the reader's layout is never used); a store
        error answers IO_ERROR for every key. ``unpin_after`` releases the pins taken with ``pin``
        (the leases keep the objects from now on). Failures are counted here, loaded objects at
        :meth:`release`. Thread-safe."""
        keys = list(keys)
        if not keys:
            return []
        t0 = time.perf_counter()
        self.wait_for_saves(keys, wait_pending_s)
        try:
            leases = list(self.store.lease(keys, ttl_s=ttl_s, wait_pending_s=wait_pending_s))
            if any(ls.status in _NO_ROOM for ls in leases):
                leases = self._read_unleased(leases, size)
        except Exception:
            logger.exception("lease of %d objects failed", len(keys))
            leases = [SlotLease(Status.IO_ERROR, k) for k in keys]
        finally:
            if unpin_after:
                self.unpin(keys)
        if size is not None:
            wrong = [ls for ls in leases if ls.status is Status.OK and ls.nbytes != size]
            if wrong:
                self.release_quietly(wrong)
                leases = [SlotLease(Status.CORRUPT, ls.key, ls.nbytes) if ls.status is Status.OK and ls.nbytes != size
                          else ls for ls in leases]
        with self._lock:
            c = self.counters
            c.load_batches += 1
            for ls in leases:
                if ls.status is not Status.OK:
                    c.load_failed += 1
                    _count_failure(c.failures, ls.status)
            self.latency.load.observe(time.perf_counter() - t0)
        return leases

    def _read_unleased(self, leases: list[SlotLease], size: int | None) -> list[SlotLease]:
        """The leases refused for want of room, read instead with one ``get_into`` into private
        buffers (``size`` bytes each, or the size the store names): a DRAM tier smaller than what
        one step loads, or a batch over this process's share, still loads from SSD rather than
        recomputing. The other leases are kept as they are."""
        idx = [i for i, ls in enumerate(leases) if ls.status in _NO_ROOM]
        sizes = self.store.size_of([leases[i].key for i in idx]) if size is None else [size] * len(idx)
        todo = [(i, n) for i, n in zip(idx, sizes) if n is not None]
        bufs = [bytearray(n) for _, n in todo]
        results = self.store.get_into([leases[i].key for i, _ in todo], bufs) if todo else []
        out = list(leases)
        for (i, _), buf, res in zip(todo, bufs, results):
            key = leases[i].key
            if res.ok:
                out[i] = CopiedLease(Status.OK, key, res.nbytes, view=memoryview(buf)[:res.nbytes].toreadonly())
            else:
                out[i] = SlotLease(res.status, key, res.nbytes)
        return out

    def release(self, leases: Sequence[SlotLease]) -> list[bool]:
        """Give back leases taken with :meth:`lease` after reading them; per lease True when its
        bytes were stable for the whole lease (counted loaded), False when not (counted a failed
        load: the caller must not use what it read). Never raises: a store error answers False.
        Thread-safe."""
        leases = list(leases)
        if not leases:
            return []
        slots = [ls for ls in leases if not isinstance(ls, CopiedLease)]
        try:
            answers = iter(self.store.release(slots) if slots else [])
            stable = [True if isinstance(ls, CopiedLease) else next(answers) for ls in leases]
        except Exception:
            logger.exception("release of %d leases failed", len(leases))
            stable = [isinstance(ls, CopiedLease) for ls in leases]
        with self._lock:
            c = self.counters
            for ls, ok in zip(leases, stable):
                if ok:
                    c.loaded_objects += 1
                    c.loaded_bytes += ls.nbytes
                else:
                    c.load_failed += 1
                    c.failures.io_error += 1
        return stable

    def release_quietly(self, leases: Sequence[SlotLease]) -> None:
        """Give back leases whose bytes will not be used (nothing counted; never raises)."""
        slots = [ls for ls in leases if not isinstance(ls, CopiedLease)]
        try:
            if slots:
                self.store.release(slots)
        except Exception:
            logger.exception("release of %d leases failed", len(slots))

    def reserve(self, keys: Sequence[str], size: int, parents: Sequence[str | None] | None = None, *,
                ttl_s: float) -> list[Reservation]:
        """Reserve a slot of ``size`` bytes per key (``KVStore.reserve``) for the caller to fill and
        then hand to :meth:`commit` (or :meth:`abort`). Blocking (one store call, no I/O); a store
        error answers IO_ERROR for every key. Failures other than EXISTS are counted as failed
        saves here. Thread-safe."""
        keys = list(keys)
        if not keys:
            return []
        try:
            res = list(self.store.reserve(keys, [size] * len(keys), parents, ttl_s=ttl_s))
        except Exception:
            logger.exception("reserve of %d objects failed", len(keys))
            res = [Reservation(Status.IO_ERROR, k) for k in keys]
        with self._lock:
            c = self.counters
            for r in res:
                if r.status is Status.EXISTS:
                    c.save_exists += 1
                elif r.status is not Status.OK:
                    c.save_failed += 1
                    _count_failure(c.failures, r.status)
        return res

    def commit(self, reservations: Sequence[Reservation], *, after: Callable[[], None] | None = None) -> Future:
        """Commit filled reservations on an I/O thread (``after`` runs there first: e.g. wait for
        the device copies into them); never blocks the caller. The future resolves to one Status
        per reservation. Until it is done the keys count as saves in flight (``lookup`` reports
        them, ``load`` and ``lease`` wait for them). When too many batches are in flight already
        the reservations are aborted at once (every key NO_SPACE, ``saves_dropped`` counted)."""
        res = list(reservations)
        if not res:
            return _done([])
        keys = [r.key for r in res]
        with self._lock:
            fut = self._submit(self._commit, res, after, time.perf_counter(), block=False)
            if fut is None:
                self.counters.saves_dropped += len(keys)
                self.counters.failures.capacity += len(keys)
            else:
                for k in keys:
                    self._pending[k] = fut
        if fut is None:
            self.abort(res)
            return _done([Status.NO_SPACE] * len(keys))
        fut.add_done_callback(lambda f, ks=keys: self._landed(ks, f))
        return fut

    def _commit(self, res: list[Reservation], after: Callable[[], None] | None, submitted: float) -> list[Status]:
        try:
            if after is not None:
                after()
            statuses = list(self.store.commit(res))
        except Exception:
            logger.exception("commit of %d objects failed", len(res))
            self.abort(res)
            statuses = [Status.IO_ERROR] * len(res)
        with self._lock:
            c = self.counters
            c.save_batches += 1
            for r, st in zip(res, statuses):
                if st is Status.OK:
                    c.saved_objects += 1
                    c.saved_bytes += r.nbytes
                elif st is Status.EXISTS:
                    c.save_exists += 1
                else:
                    c.save_failed += 1
                    _count_failure(c.failures, st)
            self.latency.save.observe(time.perf_counter() - submitted)
        return statuses

    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations that will not be committed (never raises; nothing counted)."""
        try:
            if reservations:
                self.store.abort(list(reservations))
        except Exception:
            logger.exception("abort of %d reservations failed", len(reservations))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every save submitted so far has landed (False if ``timeout_s`` passed)."""
        with self._lock:
            keys = list(self._pending)
        return self.wait_for_saves(keys, float("inf") if timeout_s is None else timeout_s)

    # -- observability -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The counters as a plain nested dict (a copy)."""
        with self._lock:
            return msgspec.to_builtins(self.counters)

    def snapshot(self) -> ConnectorStats:
        """A typed copy of the counters and latency histograms (thread-safe)."""
        with self._lock:
            return copy_stats(self.counters, self.latency)

    def count(self, *, hit_tokens: int = 0, staging_failures: int = 0, timeouts: int = 0) -> None:
        """Add what only the engine layer knows: prompt tokens it loads from the store instead of
        computing them, chunks it could not load or save for want of staging, and chunks whose
        load it stopped waiting for (thread-safe)."""
        with self._lock:
            self.counters.hit_tokens += hit_tokens
            self.counters.failures.staging += staging_failures
            self.counters.failures.timeout += timeouts


def _count_failure(failures: ConnectorFailures, status: Status) -> None:
    """Count a chunk the store did not load or save under its kind (lock held)."""
    if status is Status.CORRUPT:
        failures.checksum += 1
    elif status in (Status.NO_SPACE, Status.TOO_LARGE):
        failures.capacity += 1
    elif status is Status.NOT_FOUND:
        failures.missing += 1
    else:
        failures.io_error += 1
