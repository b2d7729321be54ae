"""Observability: the typed counters and gauges, and the same as a plain dict.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from store_backend.metrics import QueueGauges, SlotGauges, StoreStats
from store_backend.slots import SlotKind

logger = logging.getLogger(__name__)


class StoreStatsView:
    """Stats of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

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
