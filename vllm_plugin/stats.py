"""vLLM's connector stats hooks: the store's and the connector's metrics in vLLM's own ``/metrics``.

Three places, three processes (or one, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- Each worker's ``get_kv_connector_stats`` (its forward thread, every step) returns a
  :class:`TieredConnectorStats` with what moved since its last call: counter and histogram deltas
  of its store (:class:`store_backend.metrics.StoreStats`) and its client
  (:class:`mooncake_connector.metrics.ConnectorStats`), plus all its gauges (every step: vLLM
  hands a step's stats to one API server of several, and each must know every worker's). The
  scheduler's connector adds its own (prompt tokens it planned to load). vLLM aggregates these
  across workers and steps with :meth:`TieredConnectorStats.aggregate`: deltas add, and gauges
  are kept per worker (the newest of each), so a sum over workers never counts one worker twice.
- The frontend's :class:`TieredPromMetrics` (built by ``build_prom_metrics``) registers one vLLM
  metric per family of the one mapping (:mod:`store_backend.prometheus`; same names as a node
  service's ``/metrics``), with vLLM's labels (``model_name``, ``engine``) before the family's own
  (``tier``, ``kind``, ``queue``), and applies each payload: counters ``inc``, gauges ``set`` to
  the sum over workers (``multiprocess_mode="mostrecent"``, as vLLM's own gauges, when the API
  server runs several processes), histograms take the buckets' counts.
- The layout gauge (:mod:`vllm_plugin.layout_info`) is set at the frontend's start from the file
  its engine's scheduler left, and again by every scheduler payload.
- ``build_kv_connector_stats`` turns the payload dict back into a :class:`TieredConnectorStats`
  for vLLM's log line (:meth:`TieredConnectorStats.reduce`).

Payloads are plain dicts (see :func:`store_backend.prometheus.to_payload`) so they cross vLLM's
msgpack and pickle boundaries as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from mooncake_connector.config import load_connector_config
from mooncake_connector.metrics import connector_families
from store_backend.metrics import StoreStats
from store_backend.prometheus import (
    DeltaTracker,
    Family,
    PrometheusMirror,
    add_payloads,
    gauge_payload,
    split_key,
    store_families,
    to_payload,
)
from vllm_plugin.layout_info import layout_path, layout_payload, read_layout
from vllm_plugin.parallel import engine_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

DELTAS, GAUGES = "deltas", "gauges"

# Families the scheduler fills itself: its workers' clients never see how many tokens it plans to
# load, nor the lookups that never reached them.
HIT_TOKENS = "mooncake_kv_connector_hit_tokens"
ASYNC_LOADS = "mooncake_kv_connector_async_loads"
FAILURES = "mooncake_kv_connector_failures"
# The scheduler's name as a source of gauges (its workers are named by rank).
SCHEDULER = "scheduler"


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
            # A damaged chunk fails a tier's read and the connector's load: counted once in each.
            "failures": total("mooncake_kv_connector_failures"),
            "tier failures": total("mooncake_kv_tier_failures"),
        }


class StatsSource:
    """One process's side of the stats: what moved since the last :meth:`take` (not thread-safe;
    vLLM calls it from one thread)."""

    def __init__(self, worker: str) -> None:
        self._worker = worker
        self._store_families = store_families()
        self._connector_families = connector_families()
        self._families = [*self._store_families, *self._connector_families]
        self._tracker = DeltaTracker(self._families)

    def take(self, *stats: Any) -> TieredConnectorStats | None:
        """``stats`` are a StoreStats and/or a ConnectorStats (or a ready payload dict): their
        counter and histogram deltas plus all their gauges; None only for a source with no gauges
        (the scheduler's) when nothing moved."""
        now: dict[str, dict[str, Any]] = {}
        for s in stats:
            if isinstance(s, dict):
                now.update(s)
            else:
                families = self._store_families if isinstance(s, StoreStats) else self._connector_families
                now.update(to_payload(families, s))
        deltas, _changed = self._tracker.take(now)
        # Every call carries all of this source's gauges, changed or not: vLLM hands each step's
        # stats to one API server only, and a server must sum every worker's newest gauges.
        gauges = gauge_payload(self._families, now)
        if not deltas and not gauges:
            return None
        return TieredConnectorStats(data={DELTAS: deltas, GAUGES: {self._worker: gauges} if gauges else {}})


class TieredPromMetrics(KVConnectorPromMetrics):
    """Every family of the one mapping as vLLM metrics, fed with the engines' payloads (frontend)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM builds its loggers again in one process (a second engine) after dropping its own
        # metrics from the default registry; ours are dropped there the same way.
        self._mirror = PrometheusMirror(all_families(), counter_cls=self._counter_cls, gauge_cls=self._gauge_cls,
                                        histogram_cls=self._histogram_cls, labelnames=labelnames,
                                        replace_in=REGISTRY)
        self._failed = False
        self._set_layouts(vllm_config)

    def _set_layouts(self, vllm_config: VllmConfig) -> None:
        """Each engine's KV layout, from the file its scheduler wrote at start (see
        :mod:`vllm_plugin.layout_info`); an engine whose file is not here gets it with its first
        step's stats."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        if ktc is None or not ktc.engine_id:
            return
        try:
            directory = load_connector_config(ktc.kv_connector_extra_config).lookup_socket_dir
        except Exception as e:  # noqa: BLE001 (the engine core has refused it already, or will)
            logger.debug("connector config not read for the KV layout gauge: %s", e)
            return
        for engine_idx, labelvalues in self.per_engine_labelvalues.items():
            # A DP engine core appends "_dp<rank>" to the engine id it was given.
            for engine_id in (f"{ktc.engine_id}_dp{engine_idx}", ktc.engine_id):
                layout = read_layout(layout_path(engine_name(engine_id, int(engine_idx)), directory))
                if layout is not None:
                    self._mirror.apply({}, {SCHEDULER: layout_payload(layout)}, labelvalues)
                    break

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Apply one payload (vLLM's output thread). Never raises into vLLM: a payload that cannot
        be applied is logged (WARNING once, then DEBUG) and skipped."""
        try:
            self._mirror.apply(transfer_stats_data.get(DELTAS, {}), transfer_stats_data.get(GAUGES, {}),
                               self.per_engine_labelvalues.get(engine_idx, []))
        except Exception:
            logger.log(logging.DEBUG if self._failed else logging.WARNING,
                       "connector metrics payload not applied", exc_info=True)
            self._failed = True
