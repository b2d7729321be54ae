"""The fill primitive: objects from the tiers below into DRAM slots (locate, fill, commit as the DRAM
copy), used by stage-in, promotion and replicas alike; and the promotion worker.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from store_backend.checksum import object_checksum
from store_backend.coherence import Ticket
from store_backend.config import StoreConfig
from store_backend.core.common import _HIT_TABLE_MAX, _count_failure
from store_backend.dram import Entry
from store_backend.plans import should_promote
from store_backend.policies.admission import policy_uses
from store_backend.residency import ResidencyEvent
from store_backend.tiers.base import Tier
from store_backend.types import Buffer, ReadResult, Status, byte_view, copy_bytes

logger = logging.getLogger(__name__)


class StoreFill:
    """Fill of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

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
        IO_ERROR, logged; so does a copy shorter than the object). With checksums, each whole slot
        gets its object's checksum, so a lease of it is verified like a committed write (a checksum
        that raises fails its slot). Never raises for a tier's or a copy's failure: every slot comes
        back with an answer, so the caller ends each reservation it does not commit."""
        arena = self._dram.arena.view
        out = [ReadResult(Status.IO_ERROR)] * len(slots)
        if copies is not None:
            for n, ((e, tier), src) in enumerate(zip(slots, copies)):
                view = byte_view(src)[:e.size]
                if view.nbytes != e.size:  # shorter than the object: never commit a slot's old tail
                    logger.error("copy of %r from the %s tier: %d bytes for an object of %d; not kept",
                                 e.key, tier.name, view.nbytes, e.size)
                    continue
                try:
                    copy_bytes(arena[e.offset:e.offset + e.size], view)
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
            for n, ((e, _t), res) in enumerate(zip(slots, out)):
                if not res.ok:
                    continue
                try:
                    e.checksum = object_checksum(e.key, arena[e.offset:e.offset + e.size])
                except Exception:  # a slot without its checksum is not kept (the caller gives it up)
                    logger.exception("checksum of %r in its DRAM slot failed; not kept", e.key)
                    out[n] = ReadResult(Status.IO_ERROR)
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
                if self._live(e) and res.ok and not looked.removed(e.key):
                    self._commit_promoted(e, tier, ticket, events)
                else:  # removed (or its reads invalidated) while it was read, or the read failed
                    self._end_reservation(e)
                    m.store.promotions_skipped += 1
                    if res.status in (Status.CORRUPT, Status.IO_ERROR):
                        _count_failure(m.tier(tier.name).failures, res.status)
            self._bus.publish(events)
            self._slot_changed.notify_all()  # lease(wait_pending_s) waiters: promoted or dropped
