"""Per-tier counters of the store, exposed as a plain snapshot (exporters read the snapshot).

Counters are plain ints updated by the store under its lock; ``snapshot()`` copies them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TierCounters(msgspec.Struct):
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # bytes written into the tier
    bytes_out: int = 0  # bytes read out of the tier
    evictions: int = 0
    offloads: int = 0  # objects copied from this tier to the one below
    promotions: int = 0  # objects copied into this tier from the one below
    failures: int = 0  # corrupt reads, I/O errors, rejected writes


class StoreCounters(msgspec.Struct):
    puts: int = 0
    put_exists: int = 0
    put_no_space: int = 0
    gets: int = 0
    # Objects evicted from DRAM before they reached SSD (SSD fell behind, or no SSD tier).
    dropped_unpersisted: int = 0
    offload_queue_full: int = 0
    # Objects queued for SSD again: a failed or refused write, or an SSD copy the SSD tier evicted.
    offload_retries: int = 0
    # Objects the SSD admission policy (ssd.admission_policy) kept off SSD.
    offload_declined: int = 0
    promotion_queue_full: int = 0
    promotions_skipped: int = 0
    # Exceptions that escaped a background worker's batch, idle pass or loop (each logged with its traceback).
    worker_errors: int = 0
    # Background threads still running when close() reached its deadline (each logged by name; left behind).
    thread_join_timeouts: int = 0


class StoreMetrics:
    def __init__(self) -> None:
        self.dram = TierCounters()
        self.ssd = TierCounters()
        self.store = StoreCounters()

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        """Counters plus the caller's gauges (usage, queue depths) as a nested dict."""
        out: dict[str, Any] = {
            "dram": msgspec.structs.asdict(self.dram),
            "ssd": msgspec.structs.asdict(self.ssd),
            "store": msgspec.structs.asdict(self.store),
        }
        for name, value in gauges.items():
            tier, _, field = name.partition("__")
            if field:
                out.setdefault(tier, {})[field] = value
            else:
                out[name] = value
        return out
