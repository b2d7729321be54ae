"""The store's typed counters, gauges and latency histograms: the one source of truth for metrics.

Counters are plain ints (and histogram buckets plain lists) updated by the store under its own
lock, where it already holds it; nothing here takes a lock. ``TieredStore.stats()`` copies them into
a :class:`StoreStats` together with the gauges it reads at that moment; exporters (the Prometheus
mapping in :mod:`store_backend.prometheus`, the vLLM and SGLang stats hooks) read that copy.
Every field is exported by :mod:`store_backend.prometheus`, whose table must describe it (a test
fails for a field with no description), so a counter added here cannot go unexported.
"""

from __future__ import annotations

import bisect
from typing import Any, ClassVar

import msgspec

# Upper bounds (seconds) of the store's latency histogram buckets; one more bucket counts the rest.
LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Tier names as they appear in stats and metric labels ("pool": the other nodes of a pool, read
# through the pool tier). Every store reports these (a store without an SSD tier or a pool reports
# zeros for it); a tier below DRAM of another name adds its own entry, keyed by its ``Tier.name``.
TIERS: tuple[str, ...] = ("dram", "ssd", "pool")


class FailureCounters(msgspec.Struct):
    """Failed operations of one tier, by kind (each failure counts once, under one kind)."""

    checksum: int = 0
    io_error: int = 0
    capacity: int = 0
    # The pool tier's own kinds (zero for local tiers): the peer went away or could not be reached,
    # it did not answer in time, it refused the request (authentication), it broke the protocol,
    # the directory could not be reached.
    peer_gone: int = 0
    timeout: int = 0
    refused: int = 0
    protocol: int = 0
    directory: int = 0


class TierCounters(msgspec.Struct):
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    offloads: int = 0  # objects copied from this tier to the one below
    promotions: int = 0  # objects copied into this tier from the one below
    failures: FailureCounters = msgspec.field(default_factory=FailureCounters)


class TierStats(TierCounters):
    """One tier's counters and its gauges, as ``TieredStore.stats()`` reports them."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    objects: int = 0


class QueueGauges(msgspec.Struct):
    """Objects waiting in (or being handled by) each background queue."""

    offload: int = 0
    promotion: int = 0
    # Keys of pool-wide removes that a peer holding them has not confirmed yet, owed a retry
    # (pool.retry_after_s; a peer the directory counts dead less often).
    pool_remove: int = 0


class LatencyHistogram(msgspec.Struct):
    """Latencies in fixed buckets (:data:`LATENCY_BOUNDS_S`): ``counts[i]`` observations fell in
    bucket ``i`` (not cumulative; the last bucket is above every bound); ``sum_s`` is their total.
    Not thread-safe: the owner updates it under its own lock."""

    bounds_s: ClassVar[tuple[float, ...]] = LATENCY_BOUNDS_S
    counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.counts), self.sum_s)

    def minus(self, older: LatencyHistogram) -> LatencyHistogram:
        """What was observed since ``older`` (an earlier copy of this histogram)."""
        return LatencyHistogram([a - b for a, b in zip(self.counts, older.counts)], self.sum_s - older.sum_s)

    def plus(self, other: LatencyHistogram) -> LatencyHistogram:
        return LatencyHistogram([a + b for a, b in zip(self.counts, other.counts)], self.sum_s + other.sum_s)


class StoreLatency(msgspec.Struct):
    """Time the store's public calls took, from entry to return (blocking SSD I/O included)."""

    get: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)
    put: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)


class StoreCounters(msgspec.Struct):
    puts: int = 0
    put_exists: int = 0
    put_no_space: int = 0
    # Of put_no_space (and slot reserves refused for room): refused because DRAM was full of
    # objects not yet written to SSD (the newest put gives way; offload.put_wait_s had passed).
    put_no_space_dirty: int = 0
    # Objects whose put (or slot reserve) waited for the offload to make DRAM room (offload.put_wait_s).
    put_room_waits: int = 0
    gets: int = 0
    # Objects evicted from DRAM before they reached SSD: with an SSD tier, only objects whose SSD
    # writes failed MAX_OFFLOAD_ATTEMPTS times (a broken or full disk); never for a slow SSD.
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
    # Threads still running when a close() reached its deadline (each logged; left behind): background
    # workers, public calls still in flight in the store (the tiers stay open for them), SSD I/O threads.
    thread_join_timeouts: int = 0
    # Residency events dropped because the event queue was full (subscribers were told of the gap).
    events_dropped: int = 0
    # Slot API (reserve/commit/abort, lease/release): tokens handed out and taken back, by how.
    slot_reserves: int = 0
    slot_commits: int = 0
    slot_aborts: int = 0
    slot_leases: int = 0
    slot_releases: int = 0
    # Leases served by reading an object from a tier below into a slot first.
    slot_stage_ins: int = 0
    # Tokens whose TTL passed before they were committed or released (the result is void).
    slot_expired: int = 0
    # Tokens ended by reclaim(owner) (their owner's connection or process ended).
    slot_reclaimed: int = 0
    # Reservations and leases refused (NO_SPACE) because their owner holds its share of the arena.
    slot_refused: int = 0
    # Tokens given to commit/abort/release that are unknown, used already, or another owner's.
    slot_foreign: int = 0
    # Arena blocks given back (or about to be leased) after they were freed already: a bug, each
    # logged; the block is left alone, since it may belong to another object by now.
    arena_double_frees: int = 0


class SlotGauges(msgspec.Struct):
    """Slot tokens held now (``TieredStore.reserve``/``lease``) and the arena bytes they hold."""

    reservations: int = 0
    leases: int = 0
    owners: int = 0
    held_bytes: int = 0
    # Bytes of tokens whose TTL passed and that their owner has not given back (a stuck client).
    expired_held_bytes: int = 0
    # Keys pinned with a share (the node service: per client process) and the arena bytes those
    # pins count against the pinners' shares.
    pins: int = 0
    pinned_bytes: int = 0


class StoreStats(msgspec.Struct):
    """A copy of everything the store counts, plus its gauges at the moment of the copy.

    One field per tier name of :data:`TIERS` (so the encoded shape, and every exporter, stays
    fixed; the pooled tier adds its field with it); :attr:`tiers` is the same by name, fastest
    first, for code that iterates tiers."""

    dram: TierStats = msgspec.field(default_factory=TierStats)
    ssd: TierStats = msgspec.field(default_factory=TierStats)
    pool: TierStats = msgspec.field(default_factory=TierStats)
    store: StoreCounters = msgspec.field(default_factory=StoreCounters)
    queues: QueueGauges = msgspec.field(default_factory=QueueGauges)
    latency: StoreLatency = msgspec.field(default_factory=StoreLatency)
    slots: SlotGauges = msgspec.field(default_factory=SlotGauges)

    @property
    def tiers(self) -> dict[str, TierStats]:
        """Each tier's stats by name (the same objects as the fields), fastest first."""
        return {name: getattr(self, name) for name in TIERS}


class StoreMetrics:
    """The live counters a store updates (under its lock): one :class:`TierCounters` per tier
    name (those of :data:`TIERS` always, others as the store names them)."""

    def __init__(self, tier_names: tuple[str, ...] = ()) -> None:
        self.tiers: dict[str, TierCounters] = {name: TierCounters() for name in (*TIERS, *tier_names)}
        self.store = StoreCounters()
        self.latency = StoreLatency()

    @property
    def dram(self) -> TierCounters:
        return self.tiers["dram"]

    @property
    def ssd(self) -> TierCounters:
        return self.tiers["ssd"]

    def tier(self, name: str) -> TierCounters:
        """The counters of tier ``name`` (made at first use for a tier not named at construction)."""
        c = self.tiers.get(name)
        if c is None:
            c = self.tiers[name] = TierCounters()
        return c

    def snapshot(self, gauges: dict[str, dict[str, int]], queues: QueueGauges) -> StoreStats:
        """A deep copy of the counters with the caller's gauges (``TierStats`` gauge fields by
        name, per tier name); the caller holds the store's lock."""
        def tier(c: TierCounters, g: dict[str, int]) -> TierStats:
            return TierStats(**{k: v for k, v in _fields(c).items() if k != "failures"},
                             failures=msgspec.structs.replace(c.failures), **g)

        # A tier whose name StoreStats has no field for yet is counted here but not reported.
        return StoreStats(**{name: tier(self.tiers[name], gauges.get(name, {})) for name in TIERS},
                          store=msgspec.structs.replace(self.store), queues=queues,
                          latency=StoreLatency(**{f: getattr(self.latency, f).copy()
                                                   for f in StoreLatency.__struct_fields__}))


def _fields(s: msgspec.Struct) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}
