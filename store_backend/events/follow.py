"""Following a node service's residency from another process, over its KV event stream.

An embedded :class:`~store_backend.store.TieredStore` tells its subscribers every residency change
(``TieredStore.subscribe``); a node service's clients get the same from the node's published
events (``store_backend.events.publisher``): :class:`NodeResidency` subscribes to them
(:class:`~store_backend.events.subscriber.Subscriber`, with replay and snapshot resync) and offers
the store's ``subscribe(fn, on_gap)``. The changes are rebuilt by
:func:`~store_backend.events.translate.residency_of` (sizes 0; an eviction of the last copy comes
as one eviction per tier). ``on_gap`` is called whenever the subscription resyncs from a snapshot
(at its start, after a hole no replay filled, after the node restarted or the socket reconnected):
what happened in between is not known, as after an overflow of an embedded store's queue.

``fn`` and ``on_gap`` run on the subscription's own thread ("kv-index-<name>").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from store_backend.events.subscriber import SourceConfig, Subscriber
from store_backend.events.translate import residency_of
from store_backend.events.wire import KVEventBatch
from store_backend.residency import ResidencyEvent

logger = logging.getLogger(__name__)


def connectable(endpoint: str) -> str:
    """``endpoint`` as a local process connects to it: a wildcard host (``*``, ``0.0.0.0``, ``[::]``)
    becomes the loopback address."""
    for wildcard, local in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                            ("tcp://[::]:", "tcp://[::1]:")):
        if endpoint.startswith(wildcard):
            return local + endpoint[len(wildcard):]
    return endpoint


class NodeResidency:
    """The residency changes of the node service publishing on ``endpoint`` (replay and snapshots
    on ``replay_endpoint``), offered as ``subscribe(fn, on_gap) -> unsubscribe``. Without a replay
    endpoint there are no snapshots: every lost batch is a gap."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, name: str = "node", topic: str = "") -> None:
        replay = connectable(replay_endpoint) if replay_endpoint else None
        self.config = SourceConfig(name=name, endpoint=connectable(endpoint), replay_endpoint=replay,
                                   topic=topic, snapshot=replay is not None)

    def subscribe(self, fn: Callable[[list[ResidencyEvent]], None],
                  on_gap: Callable[[], None] | None = None) -> Callable[[], None]:
        gap = on_gap or (lambda: None)
        lost = [0]

        def apply(_name: str, batch: KVEventBatch) -> None:
            if sub.stats()["lost"] != lost[0]:  # a batch no replay could supply (no snapshots)
                lost[0] = sub.stats()["lost"]
                gap()
            changes = residency_of(batch.events)
            if changes:
                fn(changes)

        def replace(_name: str, _batches: list[KVEventBatch]) -> None:
            gap()  # a resync: what the node did since the last whole state is not known

        sub = Subscriber(self.config, apply, replace)
        sub.start()
        return lambda: _close(sub)


def _close(sub: Subscriber) -> None:
    if sub.close():
        logger.warning("the node events subscription %s did not stop in time", sub.config.name)
