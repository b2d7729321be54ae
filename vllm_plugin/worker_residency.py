"""What this rank's store did to this shard's chunks after they were saved, for the connector's KV
events: offloaded to SSD, promoted back, evicted from a tier, removed.

Subscribes to the store's residency events (an embedded :class:`~store_backend.store.TieredStore`'s
``subscribe``; for a node service, its published KV events, ``store_backend.events.follow``, when
its config has an ``events`` section) and keeps, for this shard's current key prefix, one change per event in a
bounded list that each step's report to the scheduler takes. The scheduler decides what to
announce (``vllm_plugin.kv_events``). When the store dropped events, or this list was full, the
report says so (a gap): the scheduler then withdraws what it announced, since it can no longer
tell what the store holds.

The subscription callback runs on the store's event thread and only appends under a short lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mooncake_connector.config import ConnectorConfig
from store_backend.events.follow import NodeResidency
from store_backend.residency import ALL_TIERS, ResidencyEvent
from vllm_plugin.metadata import ResidencyReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

MAX_CHANGES = 1 << 16

# Changes, as the report names them.
SSD_IN, SSD_OUT, DRAM_IN, DRAM_OUT, GONE = "ssd+", "ssd-", "dram+", "dram-", "gone"


def change_of(event: ResidencyEvent) -> str | None:
    """The change a residency event means for an announced chunk (None: nothing to say: a tier
    without a medium)."""
    if event.kind == "removed" and event.tier == ALL_TIERS:
        return GONE
    if event.kind == "evicted":
        if event.lost:
            return GONE
        return {"dram": DRAM_OUT, "ssd": SSD_OUT}.get(event.tier)
    if event.kind == "moved":
        return {"ssd": SSD_IN, "dram": DRAM_IN}.get(event.tier)
    if event.kind == "stored" and event.tier == "dram":
        return DRAM_IN  # a put (a save, or another engine's) made a DRAM copy visible
    return None


def _node_feed(store: object) -> NodeResidency | None:
    """A node service's residency over its event stream (None: ``store`` is not a node client, or
    the service publishes no events: nothing after a save is followed, which the log says)."""
    service_stats = getattr(store, "service_stats", None)
    got = service_stats() if callable(service_stats) else None
    if got is None:
        return None
    node = got[1]
    if not node.events_endpoint:
        logger.warning("kv_events: the node service publishes no KV events (no events section in its config): "
                       "what it does to a chunk after the save (SSD, eviction) is not announced")
        return None
    return NodeResidency(node.events_endpoint, node.events_replay_endpoint or None, name="node-residency")


class ResidencyWatch:
    """Changes to this shard's chunks since the last :meth:`take` (see the module docstring)."""

    @classmethod
    def for_worker(cls, store: object, cfg: ConnectorConfig, vllm_config: VllmConfig) -> ResidencyWatch:
        """The worker's watch: of ``store`` with ``kv_events`` and vLLM's --kv-events-config, else
        one that watches nothing (its calls do nothing, its reports are empty)."""
        events = vllm_config.kv_events_config
        if not (cfg.kv_events and events is not None and events.enable_kv_cache_events):
            return cls(None)
        if callable(getattr(store, "subscribe", None)):
            return cls(store)
        return cls(_node_feed(store))

    def __init__(self, store: object, *, max_changes: int = MAX_CHANGES) -> None:
        self._lock = threading.Lock()
        self._prefix = ""
        self._changes: list[tuple[str, str]] = []
        self._gap = False
        self._epoch = 0
        self._max = max_changes
        subscribe = getattr(store, "subscribe", None)
        self._unsubscribe: Callable[[], None] | None = (
            subscribe(self._on_events, self._on_gap) if callable(subscribe) else None)

    @property
    def watching(self) -> bool:
        """Whether the store reports its changes (an embedded store does; a node service when it
        publishes events)."""
        return self._unsubscribe is not None

    def set_prefix(self, digest: str, epoch: int = 0) -> None:
        """Watch the keys under ``digest`` (this shard's fingerprint at the current epoch) from now
        on; changes to keys of an older prefix are dropped."""
        with self._lock:
            self._prefix = f"{digest}/" if digest else ""
            self._changes.clear()
            self._gap = False  # a gap under the old prefix says nothing of the new one
            self._epoch = epoch

    def take(self) -> tuple[list[tuple[str, str]], bool]:
        """(chunk hash, change) pairs in the order the store made them, and whether some were lost."""
        with self._lock:
            changes, self._changes = self._changes, []
            gap, self._gap = self._gap, False
        return changes, gap

    def report(self, rank: int) -> dict[str, Any]:
        """The worker metadata's ``residency`` and ``residency_gaps`` for what :meth:`take` takes."""
        with self._lock:
            epoch = self._epoch
        changes, gap = self.take()
        return {"residency": [ResidencyReport(rank, h, c, epoch) for h, c in changes],
                "residency_gaps": [rank] if gap else []}

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _on_events(self, events: list[ResidencyEvent]) -> None:
        with self._lock:
            prefix = self._prefix
            if not prefix:
                return
            for e in events:
                if not e.key.startswith(prefix):
                    continue
                change = change_of(e)
                if change is None:
                    continue
                if len(self._changes) >= self._max:
                    self._gap = True
                    return
                self._changes.append((e.key[len(prefix):], change))

    def _on_gap(self) -> None:
        with self._lock:
            self._gap = True
