"""vLLM's connector stats hooks: the store's and the connector's metrics in vLLM's own ``/metrics``.

Three places, three processes (or one, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- Each worker's ``get_kv_connector_stats`` (its forward thread, every step) returns a
  :class:`TieredConnectorStats` with what moved since its last call: counter and histogram deltas
  of its store (:class:`store_backend.metrics.StoreStats`) and its client
  (:class:`mooncake_connector.metrics.ConnectorStats`), plus its gauges when they changed. The
  scheduler's connector adds its own (prompt tokens it planned to load). vLLM aggregates these
  across workers and steps with :meth:`TieredConnectorStats.aggregate`: deltas add, and gauges
  are kept per worker (the newest of each), so a sum over workers never counts one worker twice.
- The frontend's :class:`TieredPromMetrics` (built by ``build_prom_metrics``) registers one vLLM
  metric per family of the one mapping (:mod:`store_backend.prometheus`; same names as a node
  service's ``/metrics``), with vLLM's labels (``model_name``, ``engine``) before the family's own
  (``tier``, ``kind``, ``queue``), and applies each payload: counters ``inc``, gauges ``set`` to
  the sum over workers (``multiprocess_mode="mostrecent"``, as vLLM's own gauges, when the API
  server runs several processes), histograms take the buckets' counts.
- ``build_kv_connector_stats`` turns the payload dict back into a :class:`TieredConnectorStats`
  for vLLM's log line (:meth:`TieredConnectorStats.reduce`).

Payloads are plain dicts (see :func:`store_backend.prometheus.to_payload`) so they cross vLLM's
msgpack and pickle boundaries as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from mooncake_connector.metrics import connector_families
from store_backend.metrics import LATENCY_BOUNDS_S, StoreStats
from store_backend.prometheus import (
    COUNTER,
    GAUGE,
    Family,
    add_payloads,
    gauge_payload,
    payload_delta,
    split_key,
    store_families,
    to_payload,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

DELTAS, GAUGES = "deltas", "gauges"

# The family the scheduler fills itself (its workers' clients never see how many tokens it plans to load).
HIT_TOKENS = "mooncake_kv_connector_hit_tokens"


def all_families() -> list[Family]:
    """The store's families, then the connector's (the order of docs/METRICS.md)."""
    return [*store_families(), *connector_families()]


@dataclass
class TieredConnectorStats(KVConnectorStats):
    """``data = {"deltas": payload, "gauges": {worker: payload}}`` (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self.data.setdefault(DELTAS, {})
        self.data.setdefault(GAUGES, {})

    def reset(self) -> None:
        self.data = {DELTAS: {}, GAUGES: {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s deltas to these; take its gauges (a worker's newer gauges replace its
        older ones). Returns self."""
        if isinstance(other, TieredConnectorStats) and not other.is_empty():
            self.data[DELTAS] = add_payloads(self.data[DELTAS], other.data[DELTAS])
            self.data[GAUGES] = {**self.data[GAUGES], **other.data[GAUGES]}
        return self

    def is_empty(self) -> bool:
        return not self.data[DELTAS] and not self.data[GAUGES]

    def reduce(self) -> dict[str, int | float]:
        """A few totals of the interval for vLLM's log line."""
        d = self.data[DELTAS]

        def total(name: str, **labels: str) -> int:
            out = 0
            for key, v in d.get(name, {}).items():
                values = split_key(key)
                if all(val in values for val in labels.values()):
                    out += v
            return out

        return {
            "hit tokens": total("mooncake_kv_connector_hit_tokens"),
            "DRAM hits": total("mooncake_kv_tier_hits", tier="dram"),
            "SSD hits": total("mooncake_kv_tier_hits", tier="ssd"),
            "chunks saved": total("mooncake_kv_connector_saved_objects"),
            "chunks loaded": total("mooncake_kv_connector_loaded_objects"),
            "failures": total("mooncake_kv_connector_failures") + total("mooncake_kv_tier_failures"),
        }


class StatsSource:
    """One process's side of the stats: what moved since the last :meth:`take` (thread: the
    caller's; not thread-safe, vLLM calls it from one thread)."""

    def __init__(self, worker: str) -> None:
        self._worker = worker
        self._store_families = store_families()
        self._connector_families = connector_families()
        self._families = [*self._store_families, *self._connector_families]
        self._last: dict[str, dict[str, Any]] = {}
        self._last_gauges: dict[str, dict[str, Any]] = {}

    def take(self, *stats: Any) -> TieredConnectorStats | None:
        """``stats`` are a StoreStats and/or a ConnectorStats (or a ready payload dict); None when
        nothing moved."""
        now: dict[str, dict[str, Any]] = {}
        for s in stats:
            if isinstance(s, dict):
                now.update(s)
            else:
                now.update(to_payload(self._store_families if isinstance(s, StoreStats) else self._connector_families, s))
        deltas = payload_delta(now, self._last, self._families)
        gauges = gauge_payload(self._families, now)
        self._last = now
        changed = gauges != self._last_gauges
        self._last_gauges = gauges
        if not deltas and not changed:
            return None
        return TieredConnectorStats(data={DELTAS: deltas, GAUGES: {self._worker: gauges} if changed else {}})


class TieredPromMetrics(KVConnectorPromMetrics):
    """Registers every family with vLLM's metric classes and applies payloads (frontend)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families = {f.name: f for f in all_families()}
        self._metrics: dict[str, Any] = {}
        for fam in self._families.values():
            labels = [*labelnames, *fam.labels]
            if fam.kind == COUNTER:
                m = self._counter_cls(name=fam.name, documentation=fam.help, labelnames=labels)
            elif fam.kind == GAUGE:
                m = self._gauge_cls(name=fam.name, documentation=fam.help, labelnames=labels,
                                    multiprocess_mode="mostrecent")
            else:
                m = self._histogram_cls(name=fam.name, documentation=fam.help, labelnames=labels,
                                        buckets=list(LATENCY_BOUNDS_S))
            self._metrics[fam.name] = m
        # Gauges are set from the newest value each worker reported (kept here: a payload carries
        # only the workers whose gauges changed).
        self._gauges: dict[int, dict[str, dict[str, Any]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for name, samples in transfer_stats_data.get(DELTAS, {}).items():
            fam = self._families.get(name)
            if fam is None:
                continue
            for key, value in samples.items():
                child = self._metrics[name].labels(*engine, *split_key(key))
                if fam.kind == COUNTER:
                    if value > 0:
                        child.inc(value)
                else:
                    _observe_buckets(child, value)
        known = self._gauges.setdefault(engine_idx, {})
        known.update(transfer_stats_data.get(GAUGES, {}))
        sums: dict[str, dict[str, float]] = {}
        for payload in known.values():
            for name, samples in payload.items():
                into = sums.setdefault(name, {})
                for key, value in samples.items():
                    into[key] = into.get(key, 0) + value
        for name, samples in sums.items():
            if name in self._metrics:
                for key, value in samples.items():
                    self._metrics[name].labels(*engine, *split_key(key)).set(value)


def _observe_buckets(child: Any, counts_and_sum: list[float]) -> None:
    """Add a histogram delta (bucket counts, sum last) to a Prometheus histogram child.

    Prometheus histograms take single observations: each one is observed at its bucket's upper
    bound (above the last bound for the last bucket), so every count lands in its own bucket; the
    sum is then corrected to the true total where the client library lets us (prometheus_client's
    ``_sum``; another metric class keeps the approximate sum)."""
    counts, true_sum = counts_and_sum[:-1], counts_and_sum[-1]
    observed = 0.0
    for i, n in enumerate(counts):
        at = LATENCY_BOUNDS_S[i] if i < len(LATENCY_BOUNDS_S) else LATENCY_BOUNDS_S[-1] * 2
        for _ in range(int(n)):
            child.observe(at)
        observed += at * n
    total = getattr(child, "_sum", None)
    if total is not None and hasattr(total, "inc"):
        total.inc(true_sum - observed)

