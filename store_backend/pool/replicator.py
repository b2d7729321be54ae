"""Extra copies on peers (``pool.replicas`` > 1): the registrar offers each newly stored object, the
replicator places it.

:class:`Replicator` owns one thread ("mkv-pool-replicator") and a bounded queue (past it an offer is
dropped and counted: the object simply has fewer copies). Per batch: the directory's nodes and the
batch's current holders (``locate``, every node), so an object that already has its copies (one
a peer received is offered by that peer's registrar too) is left alone; the plan is the pure
:func:`store_backend.plans.replica_targets` over the live nodes that do not hold it; per target
``put_start`` (phase 1: pending, invisible) -> the bytes leased from the local store (this node's
tiers only) -> ``transport.put`` -> ``put_end`` for what the peer committed, ``put_abort`` for the
rest. A peer's EXISTS is not a copy placed (it may hold another, older object under the key): the
mark is aborted and the peer's own registrar registers what it holds. ``put_end`` records the
xxh3-64 of the bytes sent (never 0) and the source object's ``stored_at_s`` (the remove rule: a
pool-wide remove after the commit refuses the copy). Failures are counted and logged, never raised. ``start()``/``close()``; thread-safe ``offer``.
"""

from __future__ import annotations

import collections
import logging
import time

import xxhash

from store_backend.plans import replica_targets
from store_backend.pool.directory import TIER_DRAM, Directory, DirectoryUnavailable, Location
from store_backend.pool.host import PoolHost
from store_backend.pool.transport import Transport
from store_backend.threads import QueueThread
from store_backend.types import Status

logger = logging.getLogger(__name__)

# The replicator's slot owner (its leases of the bytes it sends).
REPLICATOR_OWNER = (1 << 47) + 1
QUEUE_MAX = 16384
BATCH_MAX = 64


class Replicator(QueueThread):
    def __init__(self, store: PoolHost, directory: Directory, transport: Transport, node_id: str, replicas: int, *,
                 timeout_s: float = 10.0, queue_max: int = QUEUE_MAX, batch_max: int = BATCH_MAX) -> None:
        self.store = store
        self.directory = directory
        self.transport = transport
        self.node_id = node_id
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._queue_max = queue_max
        self._batch_max = batch_max
        super().__init__("pool replicator", "mkv-pool-replicator")
        self._queue: collections.deque[tuple[str, int, float]] = collections.deque()  # key, size, stored_at_s
        self._busy = False
        self.counters = dict.fromkeys(("replicas_sent", "replicas_failed", "replicas_dropped", "replicas_skipped"), 0)

    def offer(self, key_sizes: list[tuple[str, int]] | list[tuple[str, int, float]]) -> None:
        """Queue objects just stored here for their extra copies: (key, size) or (key, size,
        stored_at_s: the commit time here; 0.0 when omitted). Never blocks; past the bound the
        rest are dropped and counted."""
        with self._cond:
            room = self._queue_max - len(self._queue)
            self._queue.extend((t[0], t[1], float(t[2]) if len(t) > 2 else 0.0)  # type: ignore[misc]
                               for t in key_sizes[:max(0, room)])
            self.counters["replicas_dropped"] += max(0, len(key_sizes) - max(0, room))
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                if self._stopping:
                    return
                self._busy = True
                batch = [self._queue.popleft() for _ in range(min(self._batch_max, len(self._queue)))]
            try:
                self._place(batch)
            except DirectoryUnavailable as e:
                self.counters["replicas_failed"] += len(batch)
                logger.warning("pool replicator: the directory is unavailable (%s); %d objects keep one copy",
                               e, len(batch))
            except Exception:
                self.counters["replicas_failed"] += len(batch)
                logger.exception("pool replicator: a batch of %d failed", len(batch))

    def _place(self, batch: list[tuple[str, int, float]]) -> None:
        keys = [k for k, _s, _a in batch]
        at = {k: a for k, _s, a in batch}
        nodes = self.directory.nodes()
        holders = [{loc.node for loc in locs} | {self.node_id} for locs in self.directory.locate(keys)]
        groups: dict[frozenset[str], list[tuple[str, int]]] = {}
        for (key, size, _a), held in zip(batch, holders):
            if len(held) >= self.replicas:
                self.counters["replicas_skipped"] += 1
                continue
            groups.setdefault(frozenset(held), []).append((key, size))
        address = {n.node_id: n.address for n in nodes if n.alive}
        for held, items in groups.items():
            others = [n for n in nodes if n.node_id not in held]
            plan = replica_targets(items, others, self.node_id, self.replicas - len(held) + 1)
            sizes = dict(items)
            for target, tkeys in plan.items():
                self._send(target, address[target], tkeys, sizes, at)

    def _send(self, target: str, address: str, keys: list[str], sizes: dict[str, int],
              at: dict[str, float] | None = None) -> None:
        committed, failed, present = send_copies(self.store, self.directory, self.transport, target, address, keys,
                                                 sizes, at or {}, self.timeout_s, REPLICATOR_OWNER)
        failed += present  # not a copy this replicator placed: the peer's registrar lists its own
        self.counters["replicas_sent"] += committed
        self.counters["replicas_failed"] += len(failed)
        if failed:
            logger.warning("pool replicator: %d of %d copies to %s failed", len(failed), len(keys), target)


def send_copies(store: PoolHost, directory: Directory, transport: Transport, target: str, address: str,
                keys: list[str], sizes: dict[str, int], at: dict[str, float], timeout_s: float,
                owner: int) -> tuple[int, list[str], list[str]]:
    """Place copies of ``keys`` (this node's own, leased from its tiers by ``owner``) on ``target``
    at ``address``: ``put_start`` (pending, invisible) -> ``transport.put`` -> ``put_end`` for what
    the peer committed, ``put_abort`` for the rest (see the module docstring). (copies placed, keys
    that failed, keys the peer answered EXISTS: it holds an object under the key already); a key
    the directory already lists on ``target`` (put_start refused) is none of them.
    Blocking; raises DirectoryUnavailable."""
    ok = directory.put_start(target, keys, [sizes[k] for k in keys], ttl_s=2 * timeout_s,
                             stored_at_s=[at.get(k, 0.0) for k in keys])
    send = [k for k, fresh in zip(keys, ok) if fresh]
    if not send:
        return 0, [], []
    leases = store.lease(send, ttl_s=2 * timeout_s, stage_in=True, owner=owner, local_only=True)
    held = [ls for ls in leases if ls.status is Status.OK]
    failed = [ls.key for ls in leases if ls.status is not Status.OK]
    committed: list[tuple[str, Location]] = []
    present: list[str] = []
    try:
        if held:
            statuses = transport.put(address, [ls.key for ls in held], [ls.view for ls in held],
                                     timeout_s=timeout_s)
            for ls, st in zip(held, statuses):
                if st is Status.OK:  # EXISTS: the peer's object, maybe another one: not ours to list
                    committed.append((ls.key, Location(target, TIER_DRAM, ls.nbytes,
                                                       xxhash.xxh3_64_intdigest(ls.view))))
                elif st is Status.EXISTS:
                    present.append(ls.key)
                else:
                    failed.append(ls.key)
    finally:
        # A lease keeps its bytes until released, even past its TTL, and objects are
        # immutable: what was sent is the object (the peer verified the frame checksum).
        store.release(leases, owner=owner)
    if committed:
        # The peer's own registrar registers them too (with its checksum); put_end makes them
        # visible now, whichever comes first.
        # False: the peer's registrar was first (its record stands), or a remove ran meanwhile
        # (then the peer registers its copy as one received from a peer, which the remove's
        # tombstone refuses, and deletes it).
        directory.put_end(target, committed, stored_at_s=[at.get(k, 0.0) for k, _l in committed])
    if failed or present:
        directory.put_abort(target, failed + present)
    return len(committed), failed, present
