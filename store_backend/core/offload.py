"""The offload: the one queue of SSD writes, the writes themselves (worker thread, or a flushing
caller), watermark demotion, and what a lower tier's own evictions make dirty again.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time

from store_backend.config import StoreConfig
from store_backend.core.common import _WAIT_SLICE_S, _WRITE_FAILED, _count_failure
from store_backend.dram import Entry, EntryState
from store_backend.plans import demotion_bytes, demotion_split
from store_backend.residency import ResidencyEvent
from store_backend.tiers.base import Tier
from store_backend.types import Status

logger = logging.getLogger(__name__)


class StoreOffload:
    """Offload of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

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
