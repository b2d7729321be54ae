"""The node service's own Prometheus families, beside the store's (:class:`NodeCollector`).

Registered next to :class:`store_backend.prometheus.StoreCollector` on the service's registry, so
one ``/metrics`` scrape carries the store's families (the same names as in the engines) and these.
``collect`` runs on the HTTP server's thread and reads the service's gauges as a snapshot
(:meth:`NodeService.node_stats`); it never raises into the server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from store_backend.prometheus import cumulative_buckets

logger = logging.getLogger(__name__)

# name -> (kind, help); every family NodeCollector yields.
NODE_FAMILIES: dict[str, tuple[str, str]] = {
    "mooncake_kv_node_connections": ("gauge", "Client connections open on the node service."),
    "mooncake_kv_node_tokens": ("gauge", "Reservations and leases open on the node service, by kind."),
    "mooncake_kv_node_held_bytes": ("gauge", "Arena bytes held by open reservations and leases."),
    "mooncake_kv_node_zombie_bytes": ("gauge", ("Arena bytes held by reservations past their TTL whose process "
                                                "still runs (a stuck client; freed when it lets go or exits).")),
    "mooncake_kv_node_processes": ("gauge", "Client processes known to the node service (connected, or holding "
                                            "slots or pins)."),
    "mooncake_kv_node_orphaned_tokens": ("gauge", ("Reservations and leases whose connection ended while their "
                                                   "process still runs (kept for the process until it ends or "
                                                   "forgets them, or exits).")),
    "mooncake_kv_node_leases_expired": ("counter", ("Leases the service ended past their TTL (their process "
                                                    "stopped answering; its release then answers False).")),
    "mooncake_kv_node_buffered_bytes": ("gauge", ("Bytes held for clients' control frames (incomplete, queued, "
                                                  "being answered) and replies being sent, all connections.")),
    "mooncake_kv_node_frames": ("counter", "Request frames the node service answered, by op."),
    "mooncake_kv_node_bad_frames": ("counter", ("Connections closed for breaking the protocol (oversized, "
                                                "undecodable, slow or out-of-order frames).")),
    "mooncake_kv_node_refused_connections": ("counter", ("Connections refused or closed for a limit, by reason "
                                                         "(permission, busy, pid_unseen, buffers).")),
    "mooncake_kv_node_loop_lag_seconds": ("gauge", ("How late the service's event loop ran its last 1 s timer "
                                                    "(a call that blocked the loop shows here).")),
    "mooncake_kv_node_op_seconds": ("histogram", ("Time from a request's arrival to its reply, by op (waits and "
                                                  "calls on the service's threads included).")),
}


class NodeCollector(Collector):
    """Families of one :class:`~store_backend.node.server.NodeService` (anything with
    ``node_stats()`` and ``refused``)."""

    def __init__(self, service: Any) -> None:
        self._service = service

    def describe(self) -> list[Metric]:
        return []  # unchecked registration: the families are built per scrape

    def collect(self) -> Iterator[Metric]:
        try:
            n = self._service.node_stats()
            refused = dict(self._service.refused)
            latency = {op: h.copy() for op, h in list(self._service.op_latency.items())}
        except Exception:
            logger.debug("node stats unavailable for this scrape", exc_info=True)
            return
        h = {name: text for name, (_kind, text) in NODE_FAMILIES.items()}
        yield GaugeMetricFamily("mooncake_kv_node_connections", h["mooncake_kv_node_connections"],
                                value=n.connections)
        tokens = GaugeMetricFamily("mooncake_kv_node_tokens", h["mooncake_kv_node_tokens"], labels=["kind"])
        tokens.add_metric(["reservation"], n.reservations)
        tokens.add_metric(["lease"], n.leases)
        yield tokens
        yield GaugeMetricFamily("mooncake_kv_node_held_bytes", h["mooncake_kv_node_held_bytes"], value=n.held_bytes)
        yield GaugeMetricFamily("mooncake_kv_node_zombie_bytes", h["mooncake_kv_node_zombie_bytes"],
                                value=n.zombie_bytes)
        yield GaugeMetricFamily("mooncake_kv_node_processes", h["mooncake_kv_node_processes"], value=n.processes)
        yield GaugeMetricFamily("mooncake_kv_node_orphaned_tokens", h["mooncake_kv_node_orphaned_tokens"],
                                value=n.orphaned)
        yield CounterMetricFamily("mooncake_kv_node_leases_expired", h["mooncake_kv_node_leases_expired"],
                                  value=n.leases_expired)
        yield GaugeMetricFamily("mooncake_kv_node_buffered_bytes", h["mooncake_kv_node_buffered_bytes"],
                                value=n.buffered_bytes)
        frames = CounterMetricFamily("mooncake_kv_node_frames", h["mooncake_kv_node_frames"], labels=["op"])
        for op, count in sorted(n.frames.items()):
            frames.add_metric([op], count)
        yield frames
        yield CounterMetricFamily("mooncake_kv_node_bad_frames", h["mooncake_kv_node_bad_frames"], value=n.bad_frames)
        ref = CounterMetricFamily("mooncake_kv_node_refused_connections", h["mooncake_kv_node_refused_connections"],
                                  labels=["reason"])
        for reason in ("permission", "busy", "pid_unseen", "buffers"):
            ref.add_metric([reason], refused.get(reason, 0))
        yield ref
        yield GaugeMetricFamily("mooncake_kv_node_loop_lag_seconds", h["mooncake_kv_node_loop_lag_seconds"],
                                value=n.loop_lag_s)
        ops = HistogramMetricFamily("mooncake_kv_node_op_seconds", h["mooncake_kv_node_op_seconds"], labels=["op"])
        for op, hist in sorted(latency.items()):
            ops.add_metric([op], cumulative_buckets(hist), hist.sum_s)
        yield ops
