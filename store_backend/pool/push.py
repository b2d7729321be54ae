"""Copies sent to a named peer on request: a prefill node pushing the chunks of a transfer to the
decode node that will load them, as they are committed, so the decode side's load is local.

:class:`Pusher` owns one thread ("mkv-pool-push") and a bounded queue of (target node, keys); past
:data:`QUEUE_MAX` keys an offer is dropped and counted (the decode side then pulls those keys over
the pool, as without a push). Per request: the target's address from the directory's live nodes,
the objects' sizes from this node's own tiers, then
:func:`store_backend.pool.replicator.send_copies` (the directory's pending mark, the bytes leased
from this node's tiers, ``transport.put`` into reserved slots on the target, verified there, and
the mark made visible or aborted). A key not held here (evicted, never committed), or already
listed on the target, is not sent; one the target already holds (its own pull of it came first)
is counted as ``pushes_present``. Failures are counted and logged, never raised.
``start()``/``close()``; thread-safe ``offer``.
"""

from __future__ import annotations

import collections
import logging

from store_backend.pool.directory import Directory, DirectoryUnavailable
from store_backend.pool.host import PoolHost
from store_backend.pool.replicator import send_copies
from store_backend.pool.transport import Transport
from store_backend.threads import QueueThread

logger = logging.getLogger(__name__)

# The pusher's slot owner (its leases of the bytes it sends).
PUSHER_OWNER = (1 << 47) + 2
QUEUE_MAX = 65536  # keys waiting to be pushed


class Pusher(QueueThread):
    def __init__(self, store: PoolHost, directory: Directory, transport: Transport, node_id: str, *,
                 timeout_s: float = 10.0, queue_max: int = QUEUE_MAX) -> None:
        self.store = store
        self.directory = directory
        self.transport = transport
        self.node_id = node_id
        self.timeout_s = timeout_s
        self._queue_max = queue_max
        super().__init__("pool pusher", "mkv-pool-push")
        self._queue: collections.deque[tuple[str, list[str]]] = collections.deque()
        self._queued_keys = 0
        self.counters = dict.fromkeys(("push_requests", "pushes_sent", "pushes_failed", "pushes_dropped",
                                       "pushes_skipped", "pushes_present"), 0)

    def offer(self, target: str, keys: list[str]) -> int:
        """Queue ``keys`` to be copied to node ``target``; how many were queued (0: dropped, the
        queue being full, the target this node, or the pusher stopped)."""
        if not keys or target == self.node_id:
            return 0
        with self._cond:
            if self._stopping or self._queued_keys + len(keys) > self._queue_max:
                self.counters["pushes_dropped"] += len(keys)
                return 0
            self._queue.append((target, list(keys)))
            self._queued_keys += len(keys)
            self.counters["push_requests"] += 1
            self._cond.notify()
        return len(keys)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                target, keys = self._queue.popleft()
                self._queued_keys -= len(keys)
            try:
                self._push(target, keys)
            except DirectoryUnavailable as e:
                self.counters["pushes_failed"] += len(keys)
                logger.warning("pool push of %d keys to %s: the directory is unavailable (%s); they will be pulled",
                               len(keys), target, e)
            except Exception:  # noqa: BLE001 - the thread must go on; the keys will be pulled
                self.counters["pushes_failed"] += len(keys)
                logger.exception("pool push of %d keys to %s failed", len(keys), target)

    def _push(self, target: str, keys: list[str]) -> None:
        address = next((n.address for n in self.directory.nodes() if n.node_id == target and n.alive), "")
        if not address:
            self.counters["pushes_failed"] += len(keys)
            logger.warning("pool push of %d keys: node %s is not a live node of the pool", len(keys), target)
            return
        sizes = {k: s for k, s in zip(keys, self.store.size_of(keys, local_only=True)) if s is not None}
        here = [k for k in keys if k in sizes]
        self.counters["pushes_skipped"] += len(keys) - len(here)
        if not here:
            return
        sent, failed, present = send_copies(self.store, self.directory, self.transport, target, address, here,
                                            sizes, {}, self.timeout_s, PUSHER_OWNER)
        self.counters["pushes_sent"] += sent
        self.counters["pushes_present"] += len(present)  # the target had it already (its own pull won)
        self.counters["pushes_failed"] += len(failed)
        if failed:
            logger.warning("pool push: %d of %d copies to %s failed (they will be pulled)", len(failed), len(here),
                           target)
