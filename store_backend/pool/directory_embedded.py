"""The embedded directory: one process, no server (the default; a pool of one node, and tests).

:class:`EmbeddedDirectory` implements :class:`store_backend.pool.directory.Directory` with plain
dicts under one lock. Liveness marks, pending puts and tombstones carry ``time.monotonic()``
deadlines, checked at lookup time (no sweeper thread). Every batch call holds the lock once, so a
reader sees all of a batch or none of it. Invalidations are delivered synchronously on the caller's
thread after the lock is released (a subscriber may take its own locks without ordering against
ours); a subscriber must not call back into the directory.

Lookups are the hot path (``leading`` over a batch should reach millions of keys per second): the
set of live nodes is cached until the earliest liveness deadline among them, so a lookup costs one
dict probe per key plus a membership test per holder.

Tombstones hold the remove's wall-clock time (``wall_clock()``, ``time.time()`` by default) besides
their deadline: a registration is refused by the rule in :mod:`store_backend.pool.directory`
(``removed_at_s >= stored_at_s - clock_skew_s``) unless the node already has a location for the key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from store_backend.pool.directory import (
    DEFAULT_CLOCK_SKEW_S,
    DEFAULT_TOMBSTONE_TTL_S,
    TIER_RANK,
    Invalidation,
    Location,
    NodeInfo,
    check_tombstones,
)

logger = logging.getLogger(__name__)


def best_first(loc: Location) -> tuple[int, str]:
    return (TIER_RANK.get(loc.tier, len(TIER_RANK)), loc.node)


def check_entries(node_id: str, entries: Sequence[tuple[str, Location]]) -> None:
    """ValueError naming the first entry whose location is not ``node_id``'s or not a Location."""
    for key, loc in entries:
        if not isinstance(loc, Location):
            raise ValueError(f"location of key {key!r} must be a Location, got {type(loc).__name__}")
        if loc.node != node_id:
            raise ValueError(f"location of key {key!r} names node {loc.node!r}, not the registering node {node_id!r}")
        if loc.tier not in TIER_RANK:
            raise ValueError(f"location of key {key!r} has tier {loc.tier!r}; expected one of {sorted(TIER_RANK)}")


def stored_times(n: int, stored_at_s: Sequence[float] | None, *, resync: bool = False) -> Sequence[float]:
    """Per entry commit time: ``stored_at_s`` checked (length, finite numbers), or 0.0 each
    (``None``, or ``resync``: a copy of unknown age). ValueError naming ``stored_at_s``."""
    if stored_at_s is None or resync:
        return [0.0] * n
    if len(stored_at_s) != n:
        raise ValueError(f"stored_at_s: {len(stored_at_s)} times for {n} entries")
    for t in stored_at_s:
        if not isinstance(t, (int, float)) or t != t or t in (float("inf"), float("-inf")):
            raise ValueError(f"stored_at_s: must be finite numbers (seconds since the epoch), got {t!r}")
    return stored_at_s


def check_clock_skew(clock_skew_s: float) -> float:
    if not isinstance(clock_skew_s, (int, float)) or not 0 <= clock_skew_s < float("inf"):
        raise ValueError(f"clock_skew_s must be a finite number >= 0, got {clock_skew_s!r}")
    return float(clock_skew_s)


class EmbeddedDirectory:
    """In-process directory. Thread-safe; never blocks on I/O; never raises DirectoryUnavailable."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 clock_skew_s: float = DEFAULT_CLOCK_SKEW_S) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._clock_skew_s = check_clock_skew(clock_skew_s)
        self._lock = threading.Lock()
        self._locs: dict[str, dict[str, Location]] = {}  # key -> node -> Location
        self._node_keys: dict[str, set[str]] = {}
        self._pending: dict[str, dict[str, float]] = {}  # key -> node -> deadline
        self._tombstones: dict[str, tuple[float, float]] = {}  # key -> (deadline, removed_at_s wall clock)
        self._infos: dict[str, NodeInfo] = {}
        self._deadlines: dict[str, float] = {}  # node -> liveness deadline
        self._live: frozenset[str] = frozenset()
        self._live_until = float("-inf")  # _live is valid while clock() < this
        self._subscribers: list[Invalidation] = []
        self._closed = False
        # Expired tombstones and pending marks are dropped when touched, and by a sweep once their
        # count doubled since the last one (amortized O(1); no sweeper thread).
        self._tomb_sweep_at = self._pend_sweep_at = 1024

    def held(self) -> dict[str, int]:
        """Records held now (what bounds its memory): ``keys`` with a location, ``tombstones`` and
        ``pending`` marks (expired ones included until they are touched or swept)."""
        with self._lock:
            return {"keys": len(self._locs), "tombstones": len(self._tombstones),
                    "pending": len(self._pending)}

    # -- helpers (lock held) ---------------------------------------------------------------------
    def _live_nodes(self, now: float) -> frozenset[str]:
        if now < self._live_until:
            return self._live
        live = [n for n, d in self._deadlines.items() if d > now]
        self._live = frozenset(live)
        self._live_until = min((self._deadlines[n] for n in live), default=float("inf"))
        return self._live

    def _drop_location(self, key: str, node_id: str) -> bool:
        locs = self._locs.get(key)
        if locs is None or locs.pop(node_id, None) is None:
            return False
        if not locs:
            del self._locs[key]
        keys = self._node_keys.get(node_id)
        if keys is not None:
            keys.discard(key)
        return True

    def _set_location(self, key: str, loc: Location) -> bool:
        """Record ``loc``; True when it replaced a different object (size or checksum changed)."""
        locs = self._locs.get(key)
        if locs is None:
            locs = self._locs[key] = {}
        old = locs.get(loc.node)
        locs[loc.node] = loc
        self._node_keys.setdefault(loc.node, set()).add(key)
        return old is not None and (old.size != loc.size or old.checksum != loc.checksum)

    def _clear_pending(self, key: str, node_id: str) -> float | None:
        pend = self._pending.get(key)
        if pend is None:
            return None
        deadline = pend.pop(node_id, None)
        if not pend:
            del self._pending[key]
        return deadline

    def _sweep(self, now: float) -> None:
        if len(self._tombstones) > self._tomb_sweep_at:
            self._tombstones = {k: t for k, t in self._tombstones.items() if t[0] > now}
            self._tomb_sweep_at = max(1024, 2 * len(self._tombstones))
        if len(self._pending) > self._pend_sweep_at:
            for key in [k for k, p in self._pending.items() if all(d <= now for d in p.values())]:
                del self._pending[key]
            self._pend_sweep_at = max(1024, 2 * len(self._pending))

    def _refused(self, key: str, node_id: str, stored_at_s: float, now: float) -> bool:
        """The rule: refused when ``node_id`` has no location for ``key`` and a live tombstone's
        removal is not clearly older than the copy (within clock_skew_s)."""
        locs = self._locs.get(key)
        if locs is not None and node_id in locs:
            return False  # rule 1: an update of a location that stands
        tomb = self._tombstones.get(key)
        if tomb is None:
            return False
        if tomb[0] <= now:
            del self._tombstones[key]
            return False
        return tomb[1] >= stored_at_s - self._clock_skew_s  # rule 2 (else rule 3: accepted)

    def _clear_node_locked(self, node_id: str) -> list[str]:
        keys = self._node_keys.pop(node_id, set())
        for key in keys:
            locs = self._locs.get(key)
            if locs is not None:
                locs.pop(node_id, None)
                if not locs:
                    del self._locs[key]
        return list(keys)

    def _notify(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._lock:
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(keys)
            except Exception:  # a subscriber's bug must not fail the mutation that already happened
                logger.exception("directory invalidation subscriber %r failed", fn)

    # -- nodes -----------------------------------------------------------------------------------
    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        with self._lock:
            now = self._clock()
            known = self._deadlines.get(info.node_id, float("-inf")) > now
            self._deadlines[info.node_id] = now + ttl_s
            self._infos[info.node_id] = msgspec.structs.replace(info, alive=True)
            self._live_until = float("-inf")
        return known

    def deregister_node(self, node_id: str) -> None:
        with self._lock:
            dropped = self._clear_node_locked(node_id)
            self._deadlines.pop(node_id, None)
            self._infos.pop(node_id, None)
            self._live_until = float("-inf")
        self._notify(dropped)

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            live = self._live_nodes(self._clock())
            infos = [msgspec.structs.replace(info, alive=n in live) for n, info in self._infos.items()]
        return sorted(infos, key=lambda i: i.node_id)

    # -- placing objects -------------------------------------------------------------------------
    def register(self, node_id: str, entries: Sequence[tuple[str, Location]], *, resync: bool = False,
                 stored_at_s: Sequence[float] | None = None) -> list[str]:
        check_entries(node_id, entries)
        times = stored_times(len(entries), stored_at_s, resync=resync)
        refused: list[str] = []
        changed: list[str] = []
        with self._lock:
            now = self._clock()
            tombstones = self._tombstones
            for (key, loc), at_s in zip(entries, times):
                if key in tombstones and self._refused(key, node_id, at_s, now):
                    refused.append(key)
                    continue
                self._clear_pending(key, node_id)
                if self._set_location(key, loc):
                    changed.append(key)
        self._notify(changed)
        return refused

    def unregister(self, node_id: str, keys: Sequence[str]) -> None:
        with self._lock:
            dropped = [k for k in keys if self._drop_location(k, node_id)]
        self._notify(dropped)

    def put_start(self, node_id: str, keys: Sequence[str], sizes: Sequence[int], ttl_s: float, *,
                  stored_at_s: Sequence[float] | None = None) -> list[bool]:
        if len(keys) != len(sizes):
            raise ValueError(f"put_start: {len(keys)} keys but {len(sizes)} sizes")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        times = stored_times(len(keys), stored_at_s)
        out: list[bool] = []
        with self._lock:
            now = self._clock()
            for key, at_s in zip(keys, times):
                locs = self._locs.get(key)
                if locs is not None and node_id in locs:
                    out.append(False)
                    continue
                if key in self._tombstones and self._refused(key, node_id, at_s, now):
                    out.append(False)
                    continue
                pend = self._pending.setdefault(key, {})
                if pend.get(node_id, float("-inf")) > now:
                    out.append(False)
                    continue
                pend[node_id] = now + ttl_s
                out.append(True)
            self._sweep(now)
        return out

    def put_end(self, node_id: str, entries: Sequence[tuple[str, Location]], *,
                stored_at_s: Sequence[float] | None = None) -> list[bool]:
        check_entries(node_id, entries)
        times = stored_times(len(entries), stored_at_s)
        out: list[bool] = []
        changed: list[str] = []
        with self._lock:
            now = self._clock()
            for (key, loc), at_s in zip(entries, times):
                deadline = self._clear_pending(key, node_id)
                if deadline is None or deadline <= now or (key in self._tombstones
                                                           and self._refused(key, node_id, at_s, now)):
                    out.append(False)
                    continue
                if self._set_location(key, loc):
                    changed.append(key)
                out.append(True)
        self._notify(changed)
        return out

    def put_abort(self, node_id: str, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._clear_pending(key, node_id)

    def _drop_key_locked(self, key: str) -> list[str]:
        """A removed key (remove, restore_tombstones): its pending marks and locations dropped (an
        in-flight replica write must not become visible afterwards); the nodes that held it."""
        self._pending.pop(key, None)
        locs = self._locs.pop(key, None) or {}
        for node_id in locs:
            nk = self._node_keys.get(node_id)
            if nk is not None:
                nk.discard(key)
        return sorted(locs)

    def restore_tombstones(self, keys: Sequence[str], removed_at_s: Sequence[float],
                           ttl_s: Sequence[float]) -> dict[str, list[str]]:
        check_tombstones(keys, removed_at_s, ttl_s)
        holders: dict[str, list[str]] = {}
        with self._lock:
            now = self._clock()
            for key, at, ttl in zip(keys, removed_at_s, ttl_s):
                cur = self._tombstones.get(key)
                if ttl <= 0 or (cur is not None and cur[0] > now):  # a key given twice: set by the first
                    continue
                self._tombstones[key] = (now + ttl, float(at))
                # As a remove: what was listed meanwhile may be an old copy, and goes.
                holders[key] = self._drop_key_locked(key)
            self._sweep(now)
        self._notify([k for k, nodes in holders.items() if nodes])
        return holders

    def remove(self, keys: Sequence[str], *, tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S) -> dict[str, list[str]]:
        if tombstone_ttl_s < 0:
            raise ValueError(f"tombstone_ttl_s must be >= 0, got {tombstone_ttl_s!r}")
        holders: dict[str, list[str]] = {}
        with self._lock:
            now = self._clock()
            tomb = (now + tombstone_ttl_s, self._wall_clock())
            for key in keys:
                self._tombstones[key] = tomb
                dropped = self._drop_key_locked(key)
                if dropped:
                    holders[key] = dropped
            self._sweep(now)
        self._notify(list(holders))
        return holders

    def clear_node(self, node_id: str) -> int:
        with self._lock:
            dropped = self._clear_node_locked(node_id)
        self._notify(dropped)
        return len(dropped)

    def prune_dead(self, older_than_s: float) -> list[str]:
        if not older_than_s >= 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s!r}")
        dropped: list[str] = []
        with self._lock:
            now = self._clock()
            gone = sorted(n for n, d in self._deadlines.items() if d + older_than_s <= now and d <= now)
            for node_id in gone:
                dropped += self._clear_node_locked(node_id)
                del self._deadlines[node_id]
                self._infos.pop(node_id, None)
            if gone:
                self._live_until = float("-inf")
        self._notify(dropped)
        return gone

    # -- lookups ---------------------------------------------------------------------------------
    def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
        out: list[list[Location]] = []
        with self._lock:
            live = self._live_nodes(self._clock())
            get = self._locs.get
            for key in keys:
                locs = get(key)
                if not locs:
                    out.append([])
                    continue
                found = [loc for n, loc in locs.items() if n in live and n != exclude]
                if len(found) > 1:
                    found.sort(key=best_first)
                out.append(found)
        return out

    def leading(self, keys: Sequence[str], *, exclude: str | None = None) -> int:
        with self._lock:
            live = self._live_nodes(self._clock())
            if exclude is not None and exclude in live:
                live = live - {exclude}
            get = self._locs.get
            isdisjoint = live.isdisjoint
            n = 0
            for locs in map(get, keys):
                # isdisjoint walks the holders in C; an absent key (None) needs no probe.
                if locs is None or isdisjoint(locs):
                    break
                n += 1
        return n

    def node_keys(self, node_id: str) -> list[str]:
        with self._lock:
            return list(self._node_keys.get(node_id, ()))

    def address_of(self, node_ids: Sequence[str]) -> dict[str, str]:
        with self._lock:
            live = self._live_nodes(self._clock())
            return {n: self._infos[n].address for n in node_ids if n in live and n in self._infos}

    # -- invalidations and lifecycle -------------------------------------------------------------
    def subscribe(self, fn: Invalidation) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                try:
                    self._subscribers.remove(fn)
                except ValueError:
                    pass

        return unsubscribe

    def close(self) -> None:
        """Drops the subscribers; the data stays (other users of the same instance keep working)."""
        with self._lock:
            self._closed = True
            self._subscribers.clear()
