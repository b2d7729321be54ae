"""The store's metrics in SGLang's ``/metrics``, fed from the backend's ``get_stats``.

SGLang asks a storage backend for its stats (``get_stats``, on its scheduler thread, when it runs
with storage metrics on) and logs what it understands of the answer (SGLang's ``StorageMetrics``:
pages and bandwidth of prefetch and backup). :class:`TieredStorageMetrics` is that answer with the
store's typed stats beside it, and :class:`StoreMetricsExporter` mirrors those stats, as deltas
since the previous call, into ``prometheus_client`` metrics named by the one mapping
(:mod:`store_backend.prometheus`): the same names a node service or vLLM serves, with SGLang's
``model_name``, ``tp_rank`` and ``pp_rank`` labels first. SGLang serves ``/metrics`` from
``prometheus_client``'s multiprocess files (its scheduler runs in another process than its HTTP
server), where only metrics made with ``prometheus_client``'s classes appear; gauges use
``multiprocess_mode="mostrecent"``.

``prometheus_client``'s default registry is process-wide and refuses a name twice, so the
metrics are made once per process (on first use, never at import) and shared by every backend in
it, each under its own label values; metrics of the same names something else registered there
before (only tests run two engines in one process) are replaced. Thread-safe; an export that
fails is logged and never reaches SGLang's scheduler.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from sglang.srt.observability.metrics_collector import StorageMetrics

from store_backend.metrics import StoreStats
from store_backend.prometheus import DeltaTracker, PrometheusMirror, store_families, to_payload

logger = logging.getLogger(__name__)

LABELNAMES = ("model_name", "tp_rank", "pp_rank")

_lock = threading.Lock()
_mirror: PrometheusMirror | None = None  # see the module docstring: one per process, made on first use


@dataclass
class TieredStorageMetrics(StorageMetrics):
    """SGLang's StorageMetrics (what it logs itself) plus the store's stats at the time of the call."""

    store: StoreStats | None = None


class StoreMetricsExporter:
    """Mirrors one backend's store stats into the process's Prometheus metrics."""

    def __init__(self, labelvalues: tuple[Any, ...]) -> None:
        self._labelvalues = tuple(str(v) for v in labelvalues)
        self._families = store_families()
        self._tracker = DeltaTracker(self._families)
        self._failed = False

    def export(self, stats: StoreStats) -> None:
        """Add what moved since the last call (blocking briefly on the process-wide lock). Never
        raises: a failure is logged (once per exporter at WARNING, then DEBUG)."""
        global _mirror
        try:
            with _lock:
                if _mirror is None:
                    _mirror = PrometheusMirror(self._families, counter_cls=Counter, gauge_cls=Gauge,
                                               histogram_cls=Histogram, labelnames=LABELNAMES, replace_in=REGISTRY)
                deltas, gauges = self._tracker.take(to_payload(self._families, stats))
                _mirror.apply(deltas, {"store": gauges} if gauges is not None else {}, self._labelvalues)
        except Exception:
            logger.log(logging.DEBUG if self._failed else logging.WARNING,
                       "store metrics not exported to Prometheus", exc_info=True)
            self._failed = True
