"""The registrar: keeps the directory's record of this node's objects true, and this node alive in it.

:class:`Registrar` subscribes to the store's :class:`~store_backend.residency.ResidencyBus`. The bus
thread only appends the events' keys to a bounded queue (never blocks; a full queue turns into a
resync). The registrar's own thread ("mkv-pool-registrar") takes them in batches, asks the store
where each key is now (``tier_of(local_only=True)``: dram, ssd or gone), hashes newly stored DRAM
objects (xxh3-64, through a lease of its own owner id: ``lease`` -> hash -> ``release``; skipped
with ``checksum`` False), and calls ``directory.register`` / ``unregister`` once per batch. New
objects (``stored`` events) are then offered to the replicator, when there is one.

Resync (after a directory that did not know this node or was out of reach, the tombstones of
the removes this node remembers restored first, see :mod:`store_backend.pool.remove_log`; then
``register`` of everything ``store.keys()`` lists, with the commit times known here and
0.0 for the rest, as ``resync=True`` would; the keys the remove rule refuses removed locally, stale locations of this node unregistered) runs at start, after the
bus dropped events (``on_gap``), when a heartbeat answers False (the directory did not know this
node: Redis restarted empty, a failover lost writes, the mark expired) and after any directory
outage. A second thread ("mkv-pool-heartbeat") publishes :class:`NodeInfo` every ``heartbeat_s``
with ``node_ttl_s``. :class:`DirectoryUnavailable` never escapes: a failed batch is kept and tried
again (with a resync once the directory answers). ``start()``/``close()``; thread-safe.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import xxhash

from store_backend.api import StoreClosedError
from store_backend.pool.directory import TIER_DRAM, Directory, DirectoryUnavailable, Location, NodeInfo, TierUsage
from store_backend.pool.host import PoolHost
from store_backend.pool.remove_log import RemoveLog
from store_backend.residency import ResidencyEvent
from store_backend.threads import Deadline, Workers
from store_backend.types import Status

logger = logging.getLogger(__name__)

# The registrar's slot owner (its leases for hashing); below the transport's owners, far above the
# node service's connection ids.
REGISTRAR_OWNER = 1 << 47
QUEUE_MAX = 65536
BATCH_MAX = 512
# Objects leased at once for hashing (a small share of the arena).
_HASH_BATCH = 16
# Checksums remembered for objects this node holds (so a move to SSD keeps its checksum).
_CHECKSUMS_MAX = 1 << 20


class Registrar:
    def __init__(self, store: PoolHost, directory: Directory, node_id: str, *, info: Callable[[], NodeInfo],
                 heartbeat_s: float = 1.0, node_ttl_s: float = 5.0, checksum: bool = True,
                 on_stored: Callable[[list[tuple[str, int, float]]], None] | None = None,
                 queue_max: int = QUEUE_MAX, batch_max: int = BATCH_MAX, pull_margin_s: float = 10.0,
                 dead_node_gc_s: float | None = None, gc_every_s: float = 60.0,
                 peer_put: Callable[[str, int], bool] | None = None, remove_log: RemoveLog | None = None,
                 on_restored: Callable[[dict[str, list[str]], dict[str, float]], object] | None = None) -> None:
        """``info()`` builds this node's :class:`NodeInfo` for each heartbeat; ``on_stored`` gets
        (key, size, stored_at_s) of objects newly stored here once registered (the replicator's offer).

        Remove rule (docs/design/POOL.md, the directory's module docstring): a ``stored`` object
        registers with ``stored_at_s`` = its event's ``at_s`` (the commit time); a copy pulled
        from a peer (``moved`` from tier "pool") with ``at_s - pull_margin_s`` (the pool's
        transfer timeout: a remove that ran while the bytes were on the way refuses it, a cache
        miss rather than stale bytes), and so does an object a peer's put stored here
        (``peer_put(key, seq)`` True for its event: a replica, whose bytes were read from the source before they
        came); other re-registrations (moves, evictions) with 0.0. A key
        the directory refuses is deleted here (``remove(local_only=True)``) and counted in
        ``refused_registrations``. ``remove_log``: a resync that follows a heartbeat finding this
        node unknown or the directory out of reach, or a directory error here, first gives the
        directory back the tombstones of the removes it remembers (``restore_tombstones``, the
        ones set counted in ``restored_tombstones``), so a directory that lost its data refuses
        old copies again; ``on_restored(holders, removed_at_s)`` gets, per key whose tombstone was
        set, the nodes whose locations were dropped with it (a copy listed before the tombstone
        came back) and the time restored, to have them delete their copies. ``dead_node_gc_s``: the heartbeat prunes nodes dead that long
        from the directory, once per ``gc_every_s``; None: never."""
        self.store = store
        self.directory = directory
        self.node_id = node_id
        self._info = info
        self.heartbeat_s = heartbeat_s
        self.node_ttl_s = node_ttl_s
        self.checksum = checksum
        self._on_stored = on_stored
        self._queue_max = queue_max
        self._batch_max = batch_max
        self._pull_margin_s = pull_margin_s
        self._dead_node_gc_s = dead_node_gc_s
        self._gc_every_s = gc_every_s
        self._peer_put = peer_put
        self._remove_log = remove_log
        self._on_restored = on_restored
        self._restore_due = True  # under _cond; the first resync restores too (an empty log at a start)
        self._cond = threading.Condition()
        # key -> (size, new, stored_at_s for the directory's remove rule)
        self._queue: collections.OrderedDict[str, tuple[int, bool, float]] = collections.OrderedDict()
        self._resync = True  # at start
        self._resynced = threading.Event()  # set once a resync completed
        self._stopping = False
        self._checksums: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Commit times (stored_at_s) of objects this node holds, from their events: a later move
        # and a resync register with them, so a put made after a pool-wide remove of its key is
        # not refused as a copy of unknown age.
        self._stored_at: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Commit times of the objects this node's own engines put here (``stored`` events that
        # are not a peer's put), kept on the bus thread as the events come: a pulled or replicated
        # copy, a remove, the loss of the last copy or a gap forgets the key. Only these times
        # let a retried remove keep a copy (committed_after); the seq of the last event seen says
        # whether they are current.
        self._own_at: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._seen_seq = 0
        self._workers = Workers("pool registrar")
        self._unsubscribe: Callable[[], None] | None = None
        self._stop_event = threading.Event()
        self.counters = dict.fromkeys(("registered", "unregistered", "resyncs", "directory_errors", "gaps",
                                       "tombstoned", "heartbeats", "hashed", "refused_registrations",
                                       "pruned_nodes", "restored_tombstones"), 0)
        self.directory_ok = True
        self.last_resync_ns = 0
        self._busy = False  # the thread is working on a batch (wait_idle)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> Registrar:
        """Subscribe to the store and start both threads (the first heartbeat and resync follow at once)."""
        seq = getattr(self.store, "residency_seq", None)
        with self._cond:
            self._seen_seq = seq() if seq is not None else 0  # what came before is not this node's to vouch for
        self._unsubscribe = self.store.subscribe(self._on_events, self._on_gap)
        for name, target in (("mkv-pool-registrar", self._run), ("mkv-pool-heartbeat", self._beat)):
            self._workers.start(target, name=name)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Unsubscribe and stop both threads (a batch in flight finishes; what is queued is
        dropped: the next start resyncs). Idempotent."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._stop_event.set()
        self._workers.join(Deadline(timeout_s))  # a thread still running is logged there

    def request_resync(self, restore: bool = False) -> None:
        """Resync soon; ``restore``: give the directory the remove log's tombstones back first
        (the directory may have lost its data)."""
        with self._cond:
            self._resync = True
            self._restore_due = self._restore_due or restore
            self._cond.notify_all()

    def committed_after(self, keys: Sequence[str], t_s: float, wait_s: float = 1.0) -> list[bool]:
        """Per key, whether this node knows its copy here is one its own engines put after the
        wall-clock time ``t_s`` (the commit time of its ``stored`` event). False when that is not
        known for sure, and then a retried remove deletes the copy (a miss at worst): a copy
        received from a peer (pulled, or a peer's put: its event's time is not its bytes' age), one
        recovered from SSD, one whose events were lost (a gap), or any key while events the store
        published before this call have not reached this registrar after ``wait_s``. Thread-safe;
        waits at most ``wait_s``."""
        seq = getattr(self.store, "residency_seq", None)
        if seq is None:
            return [False] * len(keys)
        target = seq()
        end = time.monotonic() + wait_s
        with self._cond:
            while self._seen_seq < target:
                left = end - time.monotonic()
                if left <= 0:
                    return [False] * len(keys)
                self._cond.wait(min(left, 0.05))
            return [self._own_at.get(k, 0.0) > t_s for k in keys]

    def wait_resynced(self, timeout_s: float) -> bool:
        """Whether a resync has completed (the first one runs at start) within ``timeout_s``.
        Until then, recovered copies of keys removed from the pool while this node was away may
        still be here."""
        return self._resynced.wait(timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether nothing is queued and no resync is owed within ``timeout_s`` (tests, drain)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._resync or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # -- the bus thread (quick, never blocks) --------------------------------------------------------
    def _on_events(self, events: list[ResidencyEvent]) -> None:
        with self._cond:
            for ev in events:
                peer = ev.kind == "stored" and self._peer_put is not None and self._peer_put(ev.key, ev.seq)
                self._note_own(ev, peer)
                old = self._queue.pop(ev.key, None)
                if len(self._queue) >= self._queue_max:
                    self._resync = True  # too far behind: the resync covers everything
                    continue
                if ev.kind == "removed":
                    old = None  # whatever comes after is another object
                if peer:
                    new, at_s = True, max(0.0, ev.at_s - self._pull_margin_s)  # a peer's copy
                elif ev.kind == "stored":
                    new, at_s = True, ev.at_s
                elif ev.kind == "moved" and ev.src_tier == "pool":
                    # A copy read from a peer: committed there before the read began, at the latest
                    # pull_margin_s before it landed here.
                    new, at_s = False, max(0.0, ev.at_s - self._pull_margin_s)
                else:  # the same object moved or evicted here: its commit time, if queued, stays
                    new, at_s = bool(old and old[1]), (old[2] if old else 0.0)
                self._queue[ev.key] = (ev.size or (old[0] if old else 0), new or bool(old and old[1]), at_s)
            self._cond.notify_all()

    def _note_own(self, ev: ResidencyEvent, peer: bool) -> None:
        """Keep ``_own_at`` (see __init__) for one event (``peer``: a stored event of a peer's
        put); called under ``_cond``, in seq order."""
        own = self._own_at
        if ev.seq and self._seen_seq and ev.seq != self._seen_seq + 1:
            own.clear()  # events between were dropped (the gap's own call may come later)
        self._seen_seq = max(self._seen_seq, ev.seq)
        if ev.kind == "stored" and not peer:
            own[ev.key] = ev.at_s
            own.move_to_end(ev.key)
            while len(own) > _CHECKSUMS_MAX:
                own.popitem(last=False)
        elif ev.kind in ("stored", "removed") or (ev.kind == "moved" and ev.src_tier == "pool") or (
                ev.kind == "evicted" and ev.lost):
            own.pop(ev.key, None)

    def _on_gap(self) -> None:
        with self._cond:
            self._own_at.clear()  # events were lost: no copy's origin is known any more
            self.counters["gaps"] += 1
            self._resync = True
            self._cond.notify_all()

    # -- the registrar thread ------------------------------------------------------------------------
    def _run(self) -> None:
        retry_s = max(0.05, min(self.heartbeat_s, 1.0))
        while True:
            with self._cond:
                while not self._stopping and not self._queue and not self._resync:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                if self._stopping:
                    self._busy = False
                    return
                self._busy = True
                resync = self._resync
                self._resync = False
                batch: list[tuple[str, int, bool, float]] = []
                if not resync:
                    while self._queue and len(batch) < self._batch_max:
                        key, (size, new, at_s) = self._queue.popitem(last=False)
                        batch.append((key, size, new, at_s))
            try:
                if resync:
                    self._do_resync()
                    self._resynced.set()
                else:
                    self._apply(batch)
                self.directory_ok = True
            except DirectoryUnavailable as e:
                self.counters["directory_errors"] += 1
                if self.directory_ok:
                    logger.warning("pool registrar: the directory is unavailable (%s); retrying, then resyncing", e)
                self.directory_ok = False
                with self._cond:
                    self._resync = True  # whatever was lost meanwhile, the resync covers it
                    self._restore_due = True  # and the directory may have lost its data
                if self._stop_event.wait(retry_s):
                    return
            except StoreClosedError:
                with self._cond:
                    self._busy = False
                return
            except Exception:
                logger.exception("pool registrar: a batch failed; resyncing")
                with self._cond:
                    self._resync = True
                if self._stop_event.wait(retry_s):
                    return

    def _locations(self, keys: list[str], sizes: dict[str, int], hash_new: set[str]) -> tuple[
            list[tuple[str, Location]], list[str]]:
        """(entries to register, keys to unregister) for ``keys`` as the store holds them now."""
        tiers = self.store.tier_of(keys, local_only=True)
        held = [(k, t) for k, t in zip(keys, tiers) if t is not None]
        gone = [k for k, t in zip(keys, tiers) if t is None]
        unknown = [k for k, _t in held if not sizes.get(k)]
        if unknown:
            for k, s in zip(unknown, self.store.size_of(unknown)):
                if s is not None:
                    sizes[k] = s
        if self.checksum:
            self._hash([k for k, t in held if t == TIER_DRAM and (k in hash_new or k not in self._checksums)])
        entries = [(k, Location(self.node_id, t, sizes.get(k, 0), self._checksums.get(k, 0))) for k, t in held
                   if t in ("dram", "ssd")]
        for k in gone:
            self._checksums.pop(k, None)
            self._stored_at.pop(k, None)
        return entries, gone

    def _times(self, entries: list[tuple[str, Location]], at: dict[str, float]) -> list[float]:
        """Per entry its stored_at_s: this batch's (from its event), else the one remembered, else 0.0;
        remembered for later moves and resyncs (bounded)."""
        out = []
        for k, _loc in entries:
            t = at.get(k) or self._stored_at.get(k, 0.0)
            if t:
                self._stored_at[k] = t
                self._stored_at.move_to_end(k)
            out.append(t)
        while len(self._stored_at) > _CHECKSUMS_MAX:
            self._stored_at.popitem(last=False)
        return out

    def _hash(self, keys: list[str]) -> None:
        """xxh3-64 of DRAM objects, read through leases of this registrar's own owner id."""
        for at in range(0, len(keys), _HASH_BATCH):
            chunk = keys[at:at + _HASH_BATCH]
            leases = self.store.lease(chunk, ttl_s=30.0, stage_in=False, owner=REGISTRAR_OWNER, local_only=True)
            try:
                sums = {ls.key: xxhash.xxh3_64_intdigest(ls.view) for ls in leases if ls.status is Status.OK}
            finally:
                valid = self.store.release(leases, owner=REGISTRAR_OWNER)
            for ls, ok in zip(leases, valid):
                if ok and ls.key in sums:
                    self._checksums[ls.key] = sums[ls.key]
                    self._checksums.move_to_end(ls.key)
                    self.counters["hashed"] += 1
            while len(self._checksums) > _CHECKSUMS_MAX:
                self._checksums.popitem(last=False)

    def _apply(self, batch: list[tuple[str, int, bool, float]]) -> None:
        keys = [k for k, _s, _n, _a in batch]
        sizes = {k: s for k, s, _n, _a in batch}
        new = {k for k, _s, n, _a in batch if n}
        at = {k: a for k, _s, _n, a in batch}
        refused: list[str] = []
        try:
            entries, gone = self._locations(keys, sizes, new)
            if entries:
                refused = self.directory.register(self.node_id, entries, stored_at_s=self._times(entries, at))
                self.counters["registered"] += len(entries) - len(refused)
            if gone:
                self.directory.unregister(self.node_id, gone)
                self.counters["unregistered"] += len(gone)
        except DirectoryUnavailable:
            with self._cond:  # tried again after the outage (the resync covers them too)
                for k, s, n, a in batch:
                    self._queue.setdefault(k, (s, n, a))
            raise
        if refused:
            self._drop_refused(refused)
        if self._on_stored is not None:
            no = set(refused)
            offered = [(k, loc.size, at.get(k, 0.0)) for k, loc in entries if k in new and k not in no]
            if offered:
                self._on_stored(offered)

    def _drop_refused(self, refused: list[str]) -> None:
        """Delete here the copies the directory refused (removed pool-wide after they were
        committed). A key stored again since (a ``stored`` event queued) is left to its own
        registration."""
        with self._cond:
            drop = [k for k in refused if not (k in self._queue and self._queue[k][1])]
        self.counters["refused_registrations"] += len(refused)
        if not drop:
            return
        statuses = self.store.remove(drop, local_only=True)
        self._checksums_drop(drop)
        logger.info("pool registrar: %d copies removed pool-wide after they were stored here deleted "
                    "(%d not deletable)", len(drop),
                    sum(1 for st in statuses if st not in (Status.OK, Status.NOT_FOUND)))

    def _checksums_drop(self, keys: list[str]) -> None:
        for k in keys:
            self._checksums.pop(k, None)
            self._stored_at.pop(k, None)

    def _restore_tombstones(self, log: RemoveLog) -> None:
        gone, removed_at_s, ttl_s = log.live()
        if not gone:
            return
        got = self.directory.restore_tombstones(gone, removed_at_s, ttl_s)
        if not got:
            return
        self.counters["restored_tombstones"] += len(got)
        holders = {k: nodes for k, nodes in got.items() if nodes}
        logger.warning("pool registrar: the directory had lost %d tombstones of removes this node remembers; "
                       "restored (%d keys were listed again meanwhile, their locations dropped)", len(got),
                       len(holders))
        if holders and self._on_restored is not None:
            at = dict(zip(gone, removed_at_s))
            self._on_restored(holders, {k: at[k] for k in holders})

    def _do_resync(self) -> None:
        """Register everything this node holds (``resync=True``); delete tombstoned keys locally;
        unregister what the directory still lists for this node but the node no longer holds."""
        with self._cond:
            queued = list(self._queue.items())
            self._queue.clear()  # covered by the resync
        # What the queued events knew stays known: their commit times (remembered here, so a
        # resync cut short by an outage keeps them too) and which objects are new (offered to
        # the replicator once registered).
        for k, (_size, _new, at_s) in queued:
            if at_s:
                self._stored_at[k] = at_s
        fresh = {k for k, (_size, new, _at) in queued if new}
        offered: list[tuple[str, int, float]] = []
        with self._cond:
            restore, self._restore_due = self._restore_due, False
        if restore and self._remove_log is not None:
            try:  # before this node's own copies: the tombstones also refuse its stale ones
                self._restore_tombstones(self._remove_log)
            except BaseException:
                with self._cond:
                    self._restore_due = True  # the next resync tries again
                raise
        keys = self.store.keys()
        held: set[str] = set()
        tombstoned: list[str] = []
        for at in range(0, len(keys), self._batch_max):
            chunk = keys[at:at + self._batch_max]
            entries, _gone = self._locations(chunk, {}, set())
            if entries:
                # resync=True is stored_at_s 0.0 for all; the commit times known here are passed
                # instead (a fresh put of a key removed earlier must not be refused and deleted).
                refused = self.directory.register(self.node_id, entries, stored_at_s=self._times(entries, {}))
                tombstoned += refused
                held.update(k for k, _l in entries)
                no = set(refused)
                offered += [(k, loc.size, self._stored_at.get(k, 0.0)) for k, loc in entries
                            if k in fresh and k not in no]
        held.difference_update(tombstoned)
        if tombstoned:
            statuses = self.store.remove(tombstoned, local_only=True)
            self.counters["tombstoned"] += len(tombstoned)
            logger.info("pool registrar: %d keys removed from the pool while this node was away deleted here "
                        "(%d not deletable)", len(tombstoned), sum(1 for s in statuses if s not in
                                                                 (Status.OK, Status.NOT_FOUND)))
        stale = [k for k in self.directory.node_keys(self.node_id) if k not in held]
        if stale:
            self.directory.unregister(self.node_id, stale)
        if offered and self._on_stored is not None:
            self._on_stored(offered)
        self.counters["resyncs"] += 1
        self.counters["registered"] += len(held)
        self.last_resync_ns = time.time_ns()
        logger.info("pool registrar: resynced %d objects (%d stale locations dropped)", len(held), len(stale))

    # -- the heartbeat thread ------------------------------------------------------------------------
    def _watch_nodes(self, dead_before: set[str], next_gc: float) -> tuple[set[str], float]:
        """Each heartbeat: the directory's nodes, and every node newly dead forgotten by the
        location cache (``forget_node``), so a dead peer's cached locations are not used past its
        TTL; once per ``gc_every_s`` nodes dead longer than ``dead_node_gc_s`` are pruned."""
        dead = {n.node_id for n in self.directory.nodes() if not n.alive}
        forget = getattr(self.directory, "forget_node", None)
        if forget is not None:
            for node_id in dead - dead_before:
                forget(node_id)
        now = time.monotonic()
        if self._dead_node_gc_s is not None and now >= next_gc:
            next_gc = now + self._gc_every_s
            pruned = self.directory.prune_dead(self._dead_node_gc_s)
            if pruned:
                self.counters["pruned_nodes"] += len(pruned)
                logger.info("pool: forgot %d nodes dead for over %.0f s: %s", len(pruned), self._dead_node_gc_s,
                            ", ".join(pruned[:5]))
        return dead, next_gc

    def _beat(self) -> None:
        was_down = False
        dead: set[str] = set()
        next_gc = time.monotonic() + min(self._gc_every_s, self._dead_node_gc_s or self._gc_every_s)
        while True:
            try:
                known = self.directory.heartbeat(self._info(), self.node_ttl_s)
                self.counters["heartbeats"] += 1
                first = self.counters["heartbeats"] == 1  # unknown at a start: the start's resync covers it
                if (not known and not first) or was_down:
                    if not known:
                        logger.warning("pool: the directory did not know this node (restarted empty, failed "
                                       "over, or the mark expired): resyncing")
                    self.request_resync(restore=True)
                was_down = False
                dead, next_gc = self._watch_nodes(dead, next_gc)
            except DirectoryUnavailable as e:
                if not was_down:
                    logger.warning("pool heartbeat: the directory is unavailable (%s)", e)
                was_down = True
                self.counters["directory_errors"] += 1
            except StoreClosedError:
                return
            except Exception:
                logger.exception("pool heartbeat failed")
            if self._stop_event.wait(self.heartbeat_s):
                return


def node_info(store: PoolHost, node_id: str, address: str, started_ns: int,
              counters: Callable[[], dict[str, int]] | None = None) -> NodeInfo:
    """This node's :class:`NodeInfo` now: its address, capacity and use per tier (from the store's
    stats) and counters for ``status`` (hits and misses per tier, the depth of each background
    queue as ``queue_<name>``, plus ``counters()``)."""
    st = store.stats()
    tiers = {name: TierUsage(objects=t.objects, used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes)
             for name, t in (("dram", st.dram), ("ssd", st.ssd)) if t.capacity_bytes or name == "dram"}
    out: dict[str, int] = {}
    for name, t in (("dram", st.dram), ("ssd", st.ssd), ("pool", st.pool)):
        out[f"{name}_hits"], out[f"{name}_misses"], out[f"{name}_bytes_read"] = t.hits, t.misses, t.bytes_read
    for kind in ("peer_gone", "timeout", "checksum", "refused", "protocol", "directory"):
        out[f"pool_failures_{kind}"] = getattr(st.pool.failures, kind)
    for name in st.queues.__struct_fields__:  # offload, promotion, pool_remove: waiting now
        out[f"queue_{name}"] = getattr(st.queues, name)
    if counters is not None:
        out.update(counters())
    return NodeInfo(node_id, address, started_ns=started_ns,
                    capacity_bytes=sum(t.capacity_bytes for t in tiers.values()),
                    used_bytes=sum(t.used_bytes for t in tiers.values()), tiers=tiers, counters=out)
