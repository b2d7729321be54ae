"""Flush: write down everything put before the call, and report what is not on SSD and why.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time

from store_backend.config import StoreConfig
from store_backend.core.common import _WAIT_SLICE_S, _WRITE_FAILED, MAX_OFFLOAD_ATTEMPTS
from store_backend.dram import Entry, EntryState
from store_backend.types import FlushReport

logger = logging.getLogger(__name__)


class StoreFlush:
    """Flush of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

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
