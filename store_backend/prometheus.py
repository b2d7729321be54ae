"""The one Prometheus mapping of the typed stats: names, types, units, labels and help.

Every exporter goes through this table: :class:`StoreCollector` (a ``prometheus_client``
collector over a store, for a node service's ``/metrics`` or any process that embeds a store),
the vLLM connector's ``KVConnectorPromMetrics`` and SGLang's ``get_stats``. Families are derived
from the fields of the typed Structs in :mod:`store_backend.metrics` (one family per field, or one
family per struct with the fields as a label's values); each needs one description in
:data:`DESCRIPTIONS` or :data:`LABEL_VALUES`. ``undescribed()`` lists what lacks one, and a test
fails on it, so a counter added to a Struct is exported and documented, never silently dropped.
docs/METRICS.md is generated from :func:`render_reference` (a test keeps it current).

Pure functions and one collector; nothing is registered at import. Thread-safe: the collector
reads a fresh ``stats()`` copy on each scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from store_backend.metrics import (
    TIERS,
    FailureCounters,
    LatencyHistogram,
    QueueGauges,
    SlotGauges,
    StoreCounters,
    StoreLatency,
    StoreStats,
    TierCounters,
    TierStats,
)

logger = logging.getLogger(__name__)

PREFIX = "mooncake_kv"

# Help text of every family, by name (counters without their ``_total`` suffix).
DESCRIPTIONS: dict[str, str] = {
    # per tier, counters
    "mooncake_kv_tier_hits": "Objects a get served from this tier.",
    "mooncake_kv_tier_misses": ("Objects a get looked for in this tier and did not find there (a failed read counts "
                                "too)."),
    "mooncake_kv_tier_read_bytes": "Bytes copied out of this tier to callers.",
    "mooncake_kv_tier_written_bytes": "Bytes written into this tier (puts and promotions into DRAM, offloads to SSD).",
    "mooncake_kv_tier_evictions": "Objects removed from this tier to make room (on SSD: by the SSD backend itself).",
    "mooncake_kv_tier_offloads": "Objects copied from this tier to the tier below (DRAM to SSD).",
    "mooncake_kv_tier_promotions": "Objects copied into this tier from the tier below (SSD to DRAM).",
    "mooncake_kv_tier_failures": "Failed reads and writes of this tier, by kind.",
    # per tier, gauges
    "mooncake_kv_tier_capacity_bytes": "Bytes this tier may hold.",
    "mooncake_kv_tier_used_bytes": "Bytes this tier holds now (on SSD: on disk, headers and padding included).",
    "mooncake_kv_tier_objects": "Objects this tier holds now.",
    # store-wide counters
    "mooncake_kv_store_puts": "Objects stored by put (each one once, in DRAM).",
    "mooncake_kv_store_put_exists": "Objects a put found already stored (bytes kept, nothing written).",
    "mooncake_kv_store_put_no_space": ("Objects a put refused for want of evictable DRAM (everything leased, pinned, "
                                       "in flight, or not yet written to SSD)."),
    "mooncake_kv_store_put_no_space_dirty": ("Of the puts refused for want of DRAM (and slot reserves): those refused "
                                             "because DRAM was full of objects not yet written to SSD, after "
                                             "waiting offload.put_wait_s (the SSD falls behind the writes)."),
    "mooncake_kv_store_put_room_waits": ("Objects whose put (or slot reserve) waited for the offload to make DRAM room "
                                         "(offload.put_wait_s)."),
    "mooncake_kv_store_gets": "Objects asked for by get.",
    "mooncake_kv_store_dropped_unpersisted": ("Objects evicted from DRAM before they reached SSD: with an SSD tier, only "
                                              "objects whose SSD writes kept failing (a broken or full disk)."),
    "mooncake_kv_store_offload_queue_full": ("Objects the offload queue refused (full); they are tried again when DRAM "
                                             "needs room."),
    "mooncake_kv_store_offload_retries": ("Objects queued for SSD again (a failed or refused write, or a copy the SSD "
                                          "tier evicted)."),
    "mooncake_kv_store_offload_declined": "Objects the SSD admission policy kept off SSD.",
    "mooncake_kv_store_promotion_queue_full": "Promotions the promotion queue refused (full).",
    "mooncake_kv_store_promotions_skipped": ("Promotions not done (no clean DRAM to evict, the read failed, or the key "
                                             "was removed)."),
    "mooncake_kv_store_worker_errors": "Exceptions that escaped a background worker (each logged with its traceback).",
    "mooncake_kv_store_thread_join_timeouts": ("Threads still running when a close() reached its deadline (each "
                                               "logged): background workers, calls into the store still in "
                                               "flight, SSD I/O threads."),
    "mooncake_kv_store_events_dropped": ("Residency events (stored, moved, evicted, removed) dropped because the "
                                         "event queue was full; subscribers are told of the gap and resync."),
    # slot API counters
    "mooncake_kv_store_slot_reserves": "Slots reserved for a caller to write an object into (reserve).",
    "mooncake_kv_store_slot_commits": "Reserved slots committed: their objects became visible.",
    "mooncake_kv_store_slot_aborts": "Reserved slots given back unstored (abort).",
    "mooncake_kv_store_slot_leases": "Objects leased for a caller to read out of their slot (lease).",
    "mooncake_kv_store_slot_releases": "Leases given back (release).",
    "mooncake_kv_store_slot_stage_ins": "Leases served by reading an object from a tier below into a slot first.",
    "mooncake_kv_store_slot_expired": ("Slot tokens whose TTL passed before commit or release (the commit or the "
                                       "read failed; the bytes stay held until the owner lets go)."),
    "mooncake_kv_store_slot_reclaimed": ("Slot tokens ended by reclaim (their owner's process exited, or forgot the "
                                         "tokens of a connection it lost)."),
    "mooncake_kv_store_slot_refused": ("Reservations and leases refused because their owner holds its share of the "
                                       "arena or of tokens."),
    "mooncake_kv_store_slot_foreign": ("Tokens given to commit, abort or release that were unknown, already used, or "
                                       "another owner's (nothing changed)."),
    "mooncake_kv_store_arena_double_frees": ("Arena blocks given back or leased after they were freed already (a bug; "
                                             "each is logged and the block left alone)."),
    # slot API gauges
    "mooncake_kv_slot_reservations": "Slots reserved now and not yet committed or aborted.",
    "mooncake_kv_slot_leases": "Leases held now and not yet released.",
    "mooncake_kv_slot_owners": ("Owners (node service connections that took tokens, or the embedding process) holding "
                                "slot tokens now."),
    "mooncake_kv_slot_held_bytes": "Arena bytes held by slot tokens now (reserved or leased).",
    "mooncake_kv_slot_expired_held_bytes": ("Arena bytes still held by reservations whose TTL passed (a stuck or slow "
                                            "client; freed when it lets go or its process exits)."),
    "mooncake_kv_slot_pins": ("Keys pinned against a share now (the node service: by client processes; each ends by "
                              "unpin, its TTL, or its process's exit)."),
    "mooncake_kv_slot_pinned_bytes": "Arena bytes those pins count against their pinners' shares.",
    # gauges and histograms
    "mooncake_kv_queue_depth": "Objects waiting in, or being handled by, a background queue.",
    "mooncake_kv_store_get_seconds": ("Time a store get_into call took (DRAM copies and blocking SSD reads); and a "
                                      "lease call (waits and stage-in reads included, the caller's copy not)."),
    "mooncake_kv_store_put_seconds": ("Time a store put call took (the copy into DRAM; offload is not on this path); "
                                      "and a reserve call (the caller's copy and commit not included)."),
}

# Meaning of every value a label takes, by label.
LABEL_VALUES: dict[str, dict[str, str]] = {
    "tier": {
        "dram": "host DRAM arena of this node",
        "ssd": "SSD tier of this node",
        "pool": "the other nodes of the pool (their DRAM and SSD, read over the transport)",
    },
    "kind": {
        "checksum": "a record failed its checksum or was torn (served as a miss, never as bytes)",
        "io_error": "the backend answered an I/O error or raised",
        "capacity": "no room: a write the tier refused (full disk, DRAM with nothing evictable)",
        "peer_gone": "pool: the node holding the object could not be reached or dropped the connection",
        "timeout": "pool: the node holding the object did not answer within pool.timeout_s",
        "refused": "pool: the peer refused the connection (authentication failed, too busy)",
        "protocol": "pool: the peer broke the wire protocol (a bad frame; the connection was closed)",
        "directory": ("pool: the directory (Redis) could not be reached; the pool answered misses for "
                      "pool.retry_after_s"),
    },
    "queue": {
        "offload": "objects waiting to be written from DRAM to SSD",
        "promotion": "objects waiting to be copied from SSD back into DRAM",
        "pool_remove": ("keys of pool-wide removes a peer holding them has not confirmed yet, retried every "
                        "pool.retry_after_s (a peer counted dead less often; past 4096 owed removes the oldest "
                        "is dropped, with a warning)"),
    },
}

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

Sample = tuple[tuple[str, ...], "float | LatencyHistogram"]


@dataclass(frozen=True)
class Family:
    """One metric family: ``read(stats)`` gives its samples as (label values, value); a
    histogram's value is a :class:`LatencyHistogram`."""

    name: str  # counters without the ``_total`` suffix
    kind: str
    labels: tuple[str, ...]
    help: str
    read: Callable[[Any], list[Sample]] = field(compare=False, repr=False)

    @property
    def unit(self) -> str:
        for unit in ("bytes", "seconds", "tokens"):
            if unit in self.name.removeprefix(PREFIX).split("_"):
                return unit
        return ""

    @property
    def exposed_name(self) -> str:
        return self.name + "_total" if self.kind == COUNTER else self.name


def fields_of(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    return cls.__struct_fields__


def struct_families(cls: type[msgspec.Struct], prefix: str, kind: str, get: Callable[[Any], Any],
                    descriptions: Mapping[str, str]) -> list[Family]:
    """One family per field of ``cls`` named ``{prefix}_{field}``; ``get(stats)`` is the instance.
    Help comes from ``descriptions`` by family name (empty when missing: see :func:`undescribed`)."""
    return [Family(f"{prefix}_{name}", kind, (), descriptions.get(f"{prefix}_{name}", ""),
                   lambda s, n=name: [((), getattr(get(s), n))])
            for name in fields_of(cls)]


def labelled_family(cls: type[msgspec.Struct], name: str, kind: str, label: str, get: Callable[[Any], Any],
                    descriptions: Mapping[str, str]) -> Family:
    """One family whose ``label`` takes the fields of ``cls`` as values."""
    return Family(name, kind, (label,), descriptions.get(name, ""),
                  lambda s: [((f,), getattr(get(s), f)) for f in fields_of(cls)])


def histogram_families(cls: type[msgspec.Struct], prefix: str, get: Callable[[Any], Any],
                       descriptions: Mapping[str, str]) -> list[Family]:
    """One ``{prefix}_{field}_seconds`` histogram per :class:`LatencyHistogram` field of ``cls``."""
    return [Family(f"{prefix}_{op}_seconds", HISTOGRAM, (), descriptions.get(f"{prefix}_{op}_seconds", ""),
                   lambda s, o=op: [((), getattr(get(s), o))])
            for op in fields_of(cls)]


# Field names whose exported name puts the unit last, as Prometheus names do (``..._read_bytes_total``).
_TIER_EXPORTED = {"bytes_read": "read_bytes", "bytes_written": "written_bytes"}


def _tier_families() -> list[Family]:
    """One family per :class:`TierStats` field, labelled by tier name: every tier the stats carry
    (``StoreStats.tiers``, fastest first), so a tier added below DRAM is exported as it comes."""
    gauges = [f for f in fields_of(TierStats) if f not in fields_of(TierCounters)]
    out: list[Family] = []
    for name in fields_of(TierStats):
        full = f"{PREFIX}_tier_{_TIER_EXPORTED.get(name, name)}"
        if name == "failures":
            out.append(Family(full, COUNTER, ("tier", "kind"), DESCRIPTIONS.get(full, ""), lambda s: [
                ((t, k), getattr(ts.failures, k)) for t, ts in s.tiers.items() for k in fields_of(FailureCounters)]))
        else:
            out.append(Family(full, GAUGE if name in gauges else COUNTER, ("tier",), DESCRIPTIONS.get(full, ""),
                              lambda s, n=name: [((t,), getattr(ts, n)) for t, ts in s.tiers.items()]))
    return out


def store_families() -> list[Family]:
    """Every family a :class:`StoreStats` fills, in a stable order."""
    return [
        *_tier_families(),
        *struct_families(StoreCounters, f"{PREFIX}_store", COUNTER, lambda s: s.store, DESCRIPTIONS),
        labelled_family(QueueGauges, f"{PREFIX}_queue_depth", GAUGE, "queue", lambda s: s.queues, DESCRIPTIONS),
        *histogram_families(StoreLatency, f"{PREFIX}_store", lambda s: s.latency, DESCRIPTIONS),
        *struct_families(SlotGauges, f"{PREFIX}_slot", GAUGE, lambda s: s.slots, DESCRIPTIONS),
    ]


def label_structs() -> dict[str, type[msgspec.Struct] | Sequence[str]]:
    """Where each label's values come from (for the description check)."""
    return {"tier": TIERS, "kind": FailureCounters, "queue": QueueGauges}


def undescribed(families: Iterable[Family], labels: Mapping[str, type[msgspec.Struct] | Sequence[str]],
                label_values: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    """Families without help text and label values without a meaning (must be empty)."""
    meanings = label_values if label_values is not None else LABEL_VALUES
    missing = [f.name for f in families if not f.help]
    for label, source in labels.items():
        values = fields_of(source) if isinstance(source, type) else source
        missing += [f"{label}={v}" for v in values if not meanings.get(label, {}).get(v)]
    return missing


def cumulative_buckets(h: LatencyHistogram) -> list[tuple[str, float]]:
    """``h`` as Prometheus buckets: (upper bound, observations at or below it), +Inf last."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(h.bounds_s, h.counts):
        total += n
        out.append((repr(float(bound)), float(total)))
    out.append(("+Inf", float(total + h.counts[-1])))
    return out


def to_metrics(families: Iterable[Family], stats: Any, *, const_labels: dict[str, str] | None = None
               ) -> Iterator[Metric]:
    """Prometheus metric families for ``stats`` (what a collector's ``collect()`` yields)."""
    const = const_labels or {}
    names, values = list(const), list(const.values())
    for fam in families:
        labels = names + list(fam.labels)
        metric: Metric
        if fam.kind == COUNTER:
            metric = CounterMetricFamily(fam.name, fam.help, labels=labels)
        elif fam.kind == GAUGE:
            metric = GaugeMetricFamily(fam.name, fam.help, labels=labels)
        else:
            metric = HistogramMetricFamily(fam.name, fam.help, labels=labels)
        for label_values, value in fam.read(stats):
            if isinstance(value, LatencyHistogram):
                assert isinstance(metric, HistogramMetricFamily)
                metric.add_metric(values + list(label_values), cumulative_buckets(value), value.sum_s)
            else:
                metric.add_metric(values + list(label_values), float(value))
        yield metric


class StoreCollector(Collector):
    """A ``prometheus_client`` collector over a store (anything with ``stats() -> StoreStats``).

    Register it on a registry (``registry.register(StoreCollector(store))``); each scrape reads a
    fresh copy. A store that is closed (or fails) yields nothing for that scrape, logged once per
    failure at DEBUG: a scrape never raises into the HTTP server."""

    def __init__(self, store: Any, *, const_labels: dict[str, str] | None = None) -> None:
        self._stats: Callable[[], StoreStats] = store.stats
        self._const_labels = dict(const_labels or {})
        self._families = store_families()

    def describe(self) -> list[Metric]:
        return list(to_metrics(self._families, StoreStats(), const_labels=self._const_labels))

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:
            logger.debug("store stats unavailable for this scrape", exc_info=True)
            return
        yield from to_metrics(self._families, stats, const_labels=self._const_labels)


# -- payloads: the families' samples as plain data, for exporters in another process ---------------
# {family name: {label values joined by _SEP: value}}; a histogram's value is its bucket counts with
# the sum last. Plain dicts, lists and numbers, so msgpack/JSON carry them as they are.
_SEP = "\x1f"


def to_payload(families: Iterable[Family], stats: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for fam in families:
        out[fam.name] = {_SEP.join(lv): ([*v.counts, v.sum_s] if isinstance(v, LatencyHistogram) else v)
                         for lv, v in fam.read(stats)}
    return out


def payload_delta(new: Mapping[str, Mapping[str, Any]], old: Mapping[str, Mapping[str, Any]],
                  families: Iterable[Family]) -> dict[str, dict[str, Any]]:
    """Counters and histograms of ``new`` minus ``old`` (missing in ``old``: zero); gauges are
    left out (see :func:`gauge_payload`). Only samples that moved are kept."""
    out: dict[str, dict[str, Any]] = {}
    for fam in families:
        if fam.kind == GAUGE or fam.name not in new:
            continue
        before = old.get(fam.name, {})
        moved: dict[str, Any] = {}
        for key, v in new[fam.name].items():
            if fam.kind == HISTOGRAM:
                prev = before.get(key) or [0] * len(v)
                d = [a - b for a, b in zip(v, prev)]
                if any(d[:-1]):
                    moved[key] = d
            elif (d := v - before.get(key, 0)):
                moved[key] = d
        if moved:
            out[fam.name] = moved
    return out


def gauge_payload(families: Iterable[Family], payload: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, dict[str, Any]]:
    """The gauges of ``payload`` alone."""
    return {f.name: dict(payload[f.name]) for f in families if f.kind == GAUGE and f.name in payload}


def add_payloads(a: Mapping[str, Mapping[str, Any]], b: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Samplewise sum of two delta payloads (counters add, histogram buckets and sums add)."""
    out = {name: dict(samples) for name, samples in a.items()}
    for name, samples in b.items():
        into = out.setdefault(name, {})
        for key, v in samples.items():
            if key not in into:
                into[key] = list(v) if isinstance(v, list) else v
            elif isinstance(v, list):
                into[key] = [x + y for x, y in zip(into[key], v)]
            else:
                into[key] = into[key] + v
    return out


def split_key(key: str) -> list[str]:
    """The label values of a payload key."""
    return key.split(_SEP) if key else []


def payload_key(label_values: Iterable[str]) -> str:
    """The payload key of one sample's label values (:func:`split_key` reads it back)."""
    return _SEP.join(label_values)


class DeltaTracker:
    """What moved since the last :meth:`take`, as payloads (not thread-safe: one caller thread)."""

    def __init__(self, families: Iterable[Family]) -> None:
        self._families = list(families)
        self._last: dict[str, dict[str, Any]] = {}
        self._last_gauges: dict[str, dict[str, Any]] = {}

    def take(self, now: Mapping[str, Mapping[str, Any]]
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]] | None]:
        """(counter and histogram deltas since the last call, the gauges when they changed, else None)."""
        deltas = payload_delta(now, self._last, self._families)
        gauges = gauge_payload(self._families, now)
        self._last = {k: dict(v) for k, v in now.items()}
        changed = gauges != self._last_gauges
        self._last_gauges = gauges
        return deltas, (gauges if changed else None)


class PrometheusMirror:
    """Live Prometheus metrics (``prometheus_client`` classes, or an engine's wrappers of them)
    for ``families``, fed with payloads: for a process whose ``/metrics`` is served from
    ``prometheus_client``'s own registry or multiprocess files (vLLM's frontend, SGLang's
    scheduler), where a collector cannot be added.

    ``labelnames`` come before each family's own labels; every :meth:`apply` names their values.
    Gauges are made with ``multiprocess_mode`` (how a multiprocess registry combines the gauge
    files of several processes). With ``replace_in``, metrics of the same names an earlier mirror
    registered there are unregistered first (an engine that builds its stat loggers again in one
    process, as vLLM does, drops its own the same way). Not thread-safe: one thread applies payloads."""

    def __init__(self, families: Iterable[Family], *, counter_cls: Callable[..., Any], gauge_cls: Callable[..., Any],
                 histogram_cls: Callable[..., Any], labelnames: Sequence[str] = (),
                 gauge_mode: str = "mostrecent", replace_in: CollectorRegistry | None = None) -> None:
        self._families = {f.name: f for f in families}
        if replace_in is not None:
            for collector in list(replace_in._collector_to_names):  # no public way to list collectors
                if getattr(collector, "_name", None) in self._families:
                    replace_in.unregister(collector)
        self._metrics: dict[str, Any] = {}
        for fam in self._families.values():
            labels = [*labelnames, *fam.labels]
            if fam.kind == COUNTER:
                m = counter_cls(name=fam.name, documentation=fam.help, labelnames=labels)
            elif fam.kind == GAUGE:
                m = gauge_cls(name=fam.name, documentation=fam.help, labelnames=labels, multiprocess_mode=gauge_mode)
            else:
                m = histogram_cls(name=fam.name, documentation=fam.help, labelnames=labels,
                                  buckets=list(LatencyHistogram.bounds_s))
            self._metrics[fam.name] = m
        # The newest gauges of each source, per set of leading label values: a payload may carry
        # only the sources whose gauges changed, and a gauge is the sum over sources.
        self._gauges: dict[tuple[str, ...], dict[str, dict[str, dict[str, Any]]]] = {}

    def apply(self, deltas: Mapping[str, Mapping[str, Any]], gauges: Mapping[str, Mapping[str, Mapping[str, Any]]],
              labelvalues: Sequence[object] = ()) -> None:
        """Add ``deltas`` (see :func:`payload_delta`) and set the gauges to the sum over the sources
        of ``gauges`` (``{source: gauge payload}``, merged into the sources seen before)."""
        lead = [str(v) for v in labelvalues]
        for name, samples in deltas.items():
            fam = self._families.get(name)
            if fam is None or fam.kind == GAUGE:
                continue
            for key, value in samples.items():
                child = self._metrics[name].labels(*lead, *split_key(key))
                if fam.kind == COUNTER:
                    if value > 0:
                        child.inc(value)
                else:
                    observe_buckets(child, value)
        known = self._gauges.setdefault(tuple(lead), {})
        known.update({src: dict(p) for src, p in gauges.items()})
        sums: dict[str, dict[str, float]] = {}
        for payload in known.values():
            for name, samples in payload.items():
                into = sums.setdefault(name, {})
                for key, value in samples.items():
                    into[key] = into.get(key, 0) + value
        for name, samples in sums.items():
            if name in self._metrics:
                for key, value in samples.items():
                    self._metrics[name].labels(*lead, *split_key(key)).set(value)


def observe_buckets(child: Any, counts_and_sum: Sequence[float]) -> None:
    """Add a histogram delta (bucket counts, sum last) to a Prometheus histogram child.

    A Prometheus histogram takes single observations: each one is observed at its bucket's upper
    bound (above the last bound for the last bucket), so every count lands in its own bucket; the
    sum is then corrected to the true total where the client library allows it
    (``prometheus_client``'s ``_sum``; another class keeps the approximate sum)."""
    bounds = LatencyHistogram.bounds_s
    counts, true_sum = counts_and_sum[:-1], counts_and_sum[-1]
    observed = 0.0
    for i, n in enumerate(counts):
        at = bounds[i] if i < len(bounds) else bounds[-1] * 2
        for _ in range(int(n)):
            child.observe(at)
        observed += at * n
    total = getattr(child, "_sum", None)
    if total is not None and hasattr(total, "inc"):
        total.inc(true_sum - observed)


def render_reference(sections: Sequence[tuple[str, list[Family]]],
                     label_values: Mapping[str, Mapping[str, str]]) -> str:
    """Markdown tables (for docs/METRICS.md): every family with its type, unit, labels and meaning,
    one table per section, then every label value's meaning."""
    lines: list[str] = []
    for title, families in sections:
        lines += [f"## {title}", "", "| name | type | unit | labels | meaning |", "|---|---|---|---|---|"]
        for f in families:
            labels = ", ".join(f"`{x}`" for x in f.labels) or "-"
            lines.append(f"| `{f.exposed_name}` | {f.kind} | {f.unit or '-'} | {labels} | {f.help} |")
        lines.append("")
    lines += ["## Label values", "", "| label | value | meaning |", "|---|---|---|"]
    for label, values in label_values.items():
        for value, meaning in values.items():
            lines.append(f"| `{label}` | `{value}` | {meaning} |")
    lines.append("")
    return "\n".join(lines)
