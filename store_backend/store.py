"""TieredStore: the embedded store (host DRAM over an optional SSD tier) that engines call.

Thread-safe; every public method may be called from any thread. One lock guards the index
(DRAM entries, allocator, policy, counters); byte copies run outside it on entries that are
reserved or leased, so a slow copy never blocks other callers' bookkeeping. Background movement
(offload to SSD, promotion back to DRAM) runs on two owned :class:`BatchWorker` threads started by
``start()`` and stopped by ``close()``; it is never on the put path.

Buffers: ``put`` copies from the caller's buffers before it returns (the caller may reuse them at
once); ``get_into`` copies into the caller's writable buffers before it returns. No other copy of
an object is made on the way into or out of the DRAM arena.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from store_backend.config import StoreConfig, load_config
from store_backend.dram import Entry, EntryState, HostDramTier
from store_backend.engine import BatchWorker
from store_backend.metrics import StoreMetrics
from store_backend.plans import demotion_bytes, evict_pass_order, should_promote
from store_backend.policies.admission import AdmissionPolicy, AdmitAll, make_admission, policy_uses
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.factory import open_ssd_backend
from store_backend.types import (
    Buffer,
    ReadResult,
    Status,
    byte_view,
    check_batch,
    check_key,
    copy_bytes,
    nbytes_of,
)

logger = logging.getLogger(__name__)

# Attempts to write one object to SSD (the first included) before DRAM may drop it unpersisted.
MAX_OFFLOAD_ATTEMPTS = 3

_HIT_TABLE_MAX = 1 << 16  # SSD hit counters kept for promotion decisions


class StoreClosedError(RuntimeError):
    """A call on a store after ``close()``."""


class TieredStore:
    def __init__(
        self,
        config: StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        ssd: SsdBackend | None = None,
    ) -> None:
        """Open the tiers (an SSD directory is recovered here). ``ssd`` injects a backend (tests)."""
        self.config = load_config(config)
        self.metrics_counters = StoreMetrics()
        self._lock = threading.Lock()
        self._ssd: SsdBackend | None = ssd
        # A failed open releases what it took (the /dev/shm segment, the SSD directory's lock and
        # an injected backend, which the store owns from here on), so a retry finds nothing held.
        try:
            self._dram = HostDramTier(self.config.dram)
            try:
                if self._ssd is None and self.config.ssd is not None:
                    self._ssd = open_ssd_backend(self.config.ssd)
                self._admission: AdmissionPolicy = make_admission(
                    self.config.ssd.admission_policy if self.config.ssd is not None else AdmitAll.name)
            except BaseException:
                self._dram.close()
                raise
        except BaseException:
            if self._ssd is not None:
                self._ssd.close()
            raise
        self._ssd_hits: dict[str, int] = {}
        self._closed = False
        self._started = False
        off = self.config.offload
        self._offloader: BatchWorker[str] = BatchWorker(
            "kv-offload",
            self._offload_batch,
            queue_max=off.queue_max_objects,
            batch_max=max(1, self.config.ssd.bucket_max_keys if self.config.ssd else 256),
            batch_weight=self._queued_size,
            batch_weight_max=off.batch_bytes,
            idle_hook=self._watermark_tick if off.policy == "watermark" else None,
        )
        self._promoter: BatchWorker[str] = BatchWorker(
            "kv-promote", self._promote_batch, queue_max=self.config.promotion.queue_max_objects, batch_max=32
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> TieredStore:
        """Start the background workers (idempotent). Without start(), nothing moves between tiers."""
        self._check_open()
        if not self._started and self._ssd is not None:
            self._offloader.start()
            self._promoter.start()
        self._started = True
        return self

    def close(self, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Stop workers (finishing queued offloads when ``flush``), close the SSD tier and the arena."""
        if self._closed:
            return
        self._offloader.close(drain=flush, timeout_s=timeout_s)
        self._promoter.close(drain=False, timeout_s=timeout_s)
        with self._lock:
            self._closed = True
        try:
            if self._ssd is not None:
                self._ssd.close()
        finally:
            self._dram.close()

    def __enter__(self) -> TieredStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    # -- writes ------------------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        parents: Sequence[str | None] | None = None,
    ) -> list[Status]:
        """Store immutable objects; OK once in DRAM (offload to SSD follows in the background).

        Per key: OK, EXISTS (already stored; bytes kept), INVALID_KEY, TOO_LARGE, NO_SPACE (nothing
        evictable: every resident object is leased, pinned or being written). Never blocks on I/O.
        """
        check_batch(keys, buffers)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(parents)} parents")
        views = [byte_view(b) for b in buffers]
        out = [Status.OK] * len(keys)
        reserved: list[tuple[int, Entry]] = []
        m = self.metrics_counters
        valid = [check_key(k) is None for k in keys]
        # Asked before taking the lock (the SSD index has its own): a key that reaches SSD meanwhile
        # only costs a redundant DRAM copy of the same immutable bytes.
        on_ssd = [False] * len(keys)
        if self._ssd is not None:
            idx = [i for i, ok in enumerate(valid) if ok]
            for i, hit in zip(idx, self._ssd.contains([keys[i] for i in idx])):
                on_ssd[i] = hit
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if not valid[i]:
                    out[i] = Status.INVALID_KEY
                    continue
                size = views[i].nbytes
                if size > self.config.max_object_bytes or not self._dram.fits_ever(size):
                    out[i] = Status.TOO_LARGE
                    continue
                if key in self._dram.entries or on_ssd[i]:
                    out[i] = Status.EXISTS
                    m.store.put_exists += 1
                    continue
                entry = self._reserve(key, size, None if parents is None else parents[i], promotion=False)
                if entry is None:
                    out[i] = Status.NO_SPACE
                    m.store.put_no_space += 1
                    continue
                reserved.append((i, entry))
        arena = self._dram.arena.view
        for i, entry in reserved:
            copy_bytes(arena[entry.offset:entry.offset + entry.size], views[i])
        to_offload: list[str] = []
        with self._lock:
            eager = self._ssd is not None and self._started and self.config.offload.policy == "eager"
            for _i, entry in reserved:
                self._dram.commit(entry)
                m.store.puts += 1
                m.dram.bytes_in += entry.size
                to_offload.append(entry.key)
                entry.offload_queued = eager
        if self._ssd is not None and self._started:
            if self.config.offload.policy == "eager":
                refused = self._offloader.submit(to_offload)
                if refused:
                    with self._lock:
                        m.store.offload_queue_full += refused
                        for _i, entry in reserved[len(reserved) - refused:]:  # the queue takes a prefix
                            entry.offload_queued = False
                            entry.offload_failures += 1
            elif self._over_high_watermark():
                self._offloader.kick()
        return out

    def _admitted(self, e: Entry, parent_on_ssd: bool) -> bool:
        """Whether the SSD admission policy wants ``e`` written, on the facts as they are now (lock
        held). Its prefix counts as stored when it is on SSD or in DRAM and not declined itself, so
        a declined parent declines its children in turn."""
        pe = self._dram.entries.get(e.parent) if e.parent is not None else None
        parent_stored = e.parent is None or parent_on_ssd or (pe is not None and not pe.declined)
        return self._admission.admit(e.key, e.size, uses=policy_uses(self._dram.policy, e.key),
                                     parent_stored=parent_stored)

    def _reserve(self, key: str, size: int, parent: str | None, *, promotion: bool) -> Entry | None:
        """Make a WRITING entry, evicting by policy (lock held). Promotions evict only clean entries."""
        m = self.metrics_counters
        # Dirty entries met while looking for clean victims that need a write now: their SSD write
        # failed or was never queued, the SSD tier has since evicted their copy, or admission now
        # wants one it declined before.
        retry: list[Entry] = []
        entry = None
        for persisted_only in evict_pass_order(self._ssd is not None):
            if promotion and not persisted_only:
                break

            def evict_ok(e: Entry, _p: bool = persisted_only) -> bool:
                if not _p:
                    return True
                if e.declined:  # asked again: its prefix may be stored by now, or it may be reused
                    assert self._ssd is not None
                    on_ssd = e.parent is not None and e.parent not in self._dram.entries and \
                        self._ssd.contains([e.parent])[0]
                    if not self._admitted(e, on_ssd):
                        return True
                    e.declined = False
                    if not e.offload_queued:
                        e.offload_queued = True
                        retry.append(e)
                    return False
                if not e.persisted:
                    if 0 < e.offload_failures < MAX_OFFLOAD_ATTEMPTS and not e.offload_queued:
                        e.offload_queued = True
                        retry.append(e)  # its write failed or was never queued: try again now
                    return False
                assert self._ssd is not None
                if self._ssd.contains([e.key])[0]:
                    return True
                e.persisted = False  # dirty again: write it back rather than drop the only copy
                if not e.offload_queued:
                    e.offload_queued = True
                    retry.append(e)
                return False

            def on_evict(e: Entry) -> None:
                m.dram.evictions += 1
                if self._ssd is not None and not e.clean:
                    m.store.dropped_unpersisted += 1

            entry = self._dram.reserve(key, size, parent, evict_ok, on_evict)
            if entry is not None:
                break
        if retry:
            refused = len(retry)
            if self._started:
                refused = self._offloader.submit([e.key for e in retry])
                m.store.offload_retries += len(retry) - refused
                m.store.offload_queue_full += refused
            for e in retry[len(retry) - refused:]:  # the queue takes a prefix
                e.offload_queued = False
        return entry

    # -- reads -------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy objects into the caller's writable buffers (DRAM first, else SSD).

        Per key: OK with the object's size, NOT_FOUND, BUFFER_TOO_SMALL, CORRUPT (served as a miss),
        INVALID_KEY, IO_ERROR. Blocks for SSD reads. Objects being read are leased: not evicted,
        removed or overwritten under the reader.
        """
        check_batch(keys, buffers)
        out: list[ReadResult] = [ReadResult(Status.NOT_FOUND)] * len(keys)
        leased: list[tuple[int, Entry]] = []
        below: list[int] = []
        m = self.metrics_counters
        with self._lock:
            self._check_open()
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
                for _i, entry in leased:
                    entry.leases -= 1
                    self._dram.policy.on_access(entry.key)
                    m.dram.hits += 1
                    m.dram.bytes_out += entry.size
                m.dram.misses += len(below)
        if below and self._ssd is not None:
            self._read_below(keys, buffers, below, out)
        elif below:
            with self._lock:
                m.ssd.misses += len(below)
        return out

    def _read_below(self, keys: Sequence[str], buffers: Sequence[Buffer], idx: list[int],
                    out: list[ReadResult]) -> None:
        assert self._ssd is not None
        results = self._ssd.get_into([keys[i] for i in idx], [buffers[i] for i in idx])
        promote: list[str] = []
        m = self.metrics_counters
        with self._lock:
            for i, res in zip(idx, results):
                out[i] = res
                if res.status is Status.OK:
                    m.ssd.hits += 1
                    m.ssd.bytes_out += res.nbytes
                    hits = self._ssd_hits.get(keys[i], 0) + 1
                    if should_promote(hits, self.config.promotion.admission_hits, self.config.promotion.enabled,
                                      policy_uses(self._dram.policy, keys[i])):
                        self._ssd_hits.pop(keys[i], None)
                        promote.append(keys[i])
                    else:
                        if len(self._ssd_hits) >= _HIT_TABLE_MAX:
                            self._ssd_hits.pop(next(iter(self._ssd_hits)))
                        self._ssd_hits[keys[i]] = hits
                elif res.status in (Status.CORRUPT, Status.IO_ERROR):
                    m.ssd.failures += 1
                    m.ssd.misses += 1
                else:
                    m.ssd.misses += 1
        if promote and self._started:
            refused = self._promoter.submit(promote)
            if refused:
                with self._lock:
                    m.store.promotion_queue_full += refused

    # -- queries -----------------------------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present in any tier (an object still being written is not)."""
        check_batch(keys)
        with self._lock:
            self._check_open()
            out = [check_key(k) is None and self._dram.ready(k) is not None for k in keys]
        rest = [i for i, hit in enumerate(out) if not hit and check_key(keys[i]) is None]
        if rest and self._ssd is not None:
            for i, hit in zip(rest, self._ssd.contains([keys[i] for i in rest])):
                out[i] = hit
        return out

    def exists(self, keys: Sequence[str]) -> int:
        """Number of leading keys present (for prefix-chained keys: the reusable prefix length)."""
        n = 0
        for hit in self.contains(keys):
            if not hit:
                break
            n += 1
        return n

    def tier_of(self, keys: Sequence[str]) -> list[str | None]:
        """"dram", "ssd" or None for each key (the fastest tier holding it)."""
        check_batch(keys)
        with self._lock:
            self._check_open()
            out: list[str | None] = [
                "dram" if check_key(k) is None and self._dram.ready(k) is not None else None for k in keys
            ]
        rest = [i for i, t in enumerate(out) if t is None and check_key(keys[i]) is None]
        if rest and self._ssd is not None:
            for i, hit in zip(rest, self._ssd.contains([keys[i] for i in rest])):
                out[i] = "ssd" if hit else None
        return out

    def keys(self, prefix: str = "") -> list[str]:
        """Every stored key starting with ``prefix`` (DRAM and SSD, each once). A snapshot: O(objects)."""
        with self._lock:
            self._check_open()
            out = [k for k, e in self._dram.entries.items() if e.state is EntryState.READY and k.startswith(prefix)]
        if self._ssd is not None:
            seen = set(out)
            out.extend(k for k in self._ssd.keys() if k.startswith(prefix) and k not in seen)
        return out

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        check_batch(keys)
        with self._lock:
            self._check_open()
            out: list[int | None] = []
            for k in keys:
                e = self._dram.ready(k) if check_key(k) is None else None
                out.append(None if e is None else e.size)
        rest = [i for i, s in enumerate(out) if s is None and check_key(keys[i]) is None]
        if rest and self._ssd is not None:
            for i, s in zip(rest, self._ssd.size_of([keys[i] for i in rest])):
                out[i] = s
        return out

    # -- removal and leases ------------------------------------------------------------------------
    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Delete objects from every tier. BUSY when a reader holds the DRAM copy right now."""
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        below: list[int] = []
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = Status.INVALID_KEY
                    continue
                e = self._dram.entries.get(key)
                if e is not None:
                    if e.leases or e.state is EntryState.WRITING:
                        out[i] = Status.BUSY
                        continue
                    self._dram.drop(key)
                    out[i] = Status.OK
                self._ssd_hits.pop(key, None)
                below.append(i)
        if below and self._ssd is not None:
            for i, st in zip(below, self._ssd.remove([keys[i] for i in below])):
                if st is Status.OK:
                    out[i] = Status.OK
        return out

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]:
        """Lease objects for an in-flight load: DRAM copies are not evicted until ``unpin`` or
        ``ttl_s`` passes (so a crashed caller cannot pin forever). SSD-only objects are queued for
        promotion so the load that follows is served from DRAM. Returns presence per key."""
        present = self.contains(keys)
        deadline = time.monotonic() + ttl_s
        promote: list[str] = []
        with self._lock:
            for key, hit in zip(keys, present):
                if not hit:
                    continue
                e = self._dram.ready(key)
                if e is None:
                    promote.append(key)
                    continue
                e.pins += 1
                e.pin_deadline = max(e.pin_deadline, deadline)
        if promote and self._started and self.config.promotion.enabled:
            self._promoter.submit(promote)
        return present

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                e = self._dram.entries.get(key)
                if e is not None and e.pins > 0:
                    e.pins -= 1

    # -- background movement -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued offloads and promotions are done (False on timeout).

        In watermark mode this also runs a demotion pass first, if DRAM is above its high mark.
        """
        if not self._started or self._ssd is None:
            return True
        if self.config.offload.policy == "watermark":
            self._offloader.kick()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ok = self._offloader.wait_idle(timeout_s)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._promoter.wait_idle(remaining) and ok

    def _queued_size(self, key: str) -> int:
        e = self._dram.entries.get(key)  # racy read of a dict is safe; only used to size batches
        return 0 if e is None else e.size

    def _over_high_watermark(self) -> bool:
        off = self.config.offload
        return demotion_bytes(self._dram.used_bytes, self._dram.capacity_bytes,
                              off.high_watermark, off.low_watermark) > 0

    def _offload_batch(self, keys: list[str], *, demote: bool = False) -> None:
        """Worker thread: copy DRAM objects to SSD straight from the arena; with ``demote``, free
        them from DRAM afterwards (watermark mode)."""
        assert self._ssd is not None
        m = self.metrics_counters
        with self._lock:
            if self._closed:
                return
            todo = [e for e in map(self._dram.ready, keys) if e is not None and not e.clean]
            for key in keys:
                if (queued := self._dram.entries.get(key)) is not None:
                    queued.offload_queued = False
            parents = {e.parent for e in todo if e.parent is not None and e.parent not in self._dram.entries}
        # Asked outside the store lock (the SSD index has its own); a parent that leaves SSD meanwhile
        # only costs one write that admission would have skipped.
        parents_on_ssd = {p for p, hit in zip(parents, self._ssd.contains(list(parents))) if hit}
        with self._lock:
            batch: list[Entry] = []
            for e in todo:
                if self._dram.entries.get(e.key) is not e or e.clean:
                    continue
                if not self._admitted(e, e.parent in parents_on_ssd):
                    e.declined = True  # asked again when DRAM wants to evict it
                    m.store.offload_declined += 1
                    if demote and e.leases == 0 and e.pins == 0:
                        self._dram.drop(e.key)
                        m.dram.evictions += 1
                    continue
                e.leases += 1
                batch.append(e)
        if not batch:
            return
        arena = self._dram.arena.view
        try:
            statuses = self._ssd.put([e.key for e in batch], [arena[e.offset:e.offset + e.size] for e in batch])
        except Exception:
            statuses = [Status.IO_ERROR] * len(batch)
            logger.exception("offload of %d objects failed", len(batch))
        with self._lock:
            for e, st in zip(batch, statuses):
                e.leases -= 1
                if st.ok:
                    e.persisted = True
                    e.offload_failures = 0
                    m.dram.offloads += 1
                    m.ssd.bytes_in += e.size if st is Status.OK else 0
                    if demote and e.leases == 0 and e.pins == 0 and self._dram.entries.get(e.key) is e:
                        self._dram.drop(e.key)
                        m.dram.evictions += 1
                else:
                    e.offload_failures += 1  # retried when DRAM needs the room (see _reserve)
                    m.ssd.failures += 1

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
            persisted = [k for k in victims if entries[k].persisted]
            assert self._ssd is not None
            for k, on_ssd in zip(persisted, self._ssd.contains(persisted)):
                if not on_ssd:  # the SSD tier evicted its copy since: write it again below
                    entries[k].persisted = False
            for k in victims:  # declined before: asked again, as in _reserve
                e = entries[k]
                if e.declined and self._admitted(e, e.parent is not None and e.parent not in entries
                                                 and self._ssd.contains([e.parent])[0]):
                    e.declined = False
            clean = [k for k in victims if entries[k].clean]
            for k in clean:  # already on SSD: nothing to write, just free DRAM
                self._dram.drop(k)
                self.metrics_counters.dram.evictions += 1
            dirty = [k for k in victims if k not in clean]
        budget = off.batch_bytes
        chunk: list[str] = []
        for k in dirty:
            chunk.append(k)
            budget -= self._queued_size(k)
            if budget <= 0:
                self._offload_batch(chunk, demote=True)
                chunk, budget = [], off.batch_bytes
        if chunk:
            self._offload_batch(chunk, demote=True)

    def _promote_batch(self, keys: list[str]) -> None:
        """Worker thread: copy hot SSD objects back into DRAM, evicting only clean objects."""
        assert self._ssd is not None
        m = self.metrics_counters
        sizes = self._ssd.size_of(keys)
        reserved: list[Entry] = []
        with self._lock:
            if self._closed:
                return
            for key, size in zip(keys, sizes):
                if size is None or key in self._dram.entries:
                    continue
                e = self._reserve(key, size, None, promotion=True)
                if e is None:
                    m.store.promotions_skipped += 1
                    continue
                reserved.append(e)
        if not reserved:
            return
        arena = self._dram.arena.view
        results = self._ssd.get_into([e.key for e in reserved],
                                     [arena[e.offset:e.offset + e.size] for e in reserved])
        with self._lock:
            for e, res in zip(reserved, results):
                if res.status is Status.OK and res.nbytes == e.size:
                    e.persisted = True
                    self._dram.commit(e)
                    m.dram.promotions += 1
                    m.dram.bytes_in += e.size
                else:
                    self._dram.drop(e.key)
                    m.store.promotions_skipped += 1

    # -- observability -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counters per tier plus usage gauges, as a plain nested dict (a copy)."""
        with self._lock:
            gauges: dict[str, Any] = {
                "dram__used_bytes": self._dram.used_bytes,
                "dram__capacity_bytes": self._dram.capacity_bytes,
                "dram__objects": len(self._dram.entries),
                "store__offload_queue": self._offloader.depth,
                "store__promotion_queue": self._promoter.depth,
            }
            snap = self.metrics_counters.snapshot(**gauges)
        if self._ssd is not None:
            st = self._ssd.stats()
            snap["ssd"].update(used_bytes=st.used_bytes, capacity_bytes=st.capacity_bytes, objects=st.objects,
                               backend_evictions=st.evictions, corrupt_reads=st.corrupt_reads,
                               recovered_objects=st.recovered_objects)
        return snap
