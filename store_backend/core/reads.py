"""Reads: get_into (DRAM first, then each tier below in order) and keeping what another node served as
a local replica.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from store_backend.coherence import Ticket
from store_backend.config import StoreConfig
from store_backend.core.common import _count_failure
from store_backend.dram import Entry
from store_backend.residency import ResidencyEvent
from store_backend.tiers.base import Tier
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_batch, check_key, copy_bytes, nbytes_of

logger = logging.getLogger(__name__)


class StoreReads:
    """Reads of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

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
