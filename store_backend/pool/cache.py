"""A node's cache of locations it looked up: :class:`CachedDirectory` wraps another Directory.

Positive ``locate`` answers (keys with at least one location) are kept, at most ``max_entries``
of them (least recently used dropped first), each for at most ``cache_ttl_s``. An entry is
forgotten when

- the inner directory's invalidations name its key (subscribed on the first lookup);
- a mutation made through this wrapper touches its key (register, unregister, put_end, remove,
  clear_node and deregister_node of a node drop that node's entries);
- :meth:`CachedDirectory.nodes` reports a node dead (every entry naming it goes) or
  :meth:`CachedDirectory.heartbeat` answers False (the directory lost data: everything goes);
- the inner directory's invalidation channel was (re)joined (``on_gap``, where it has one:
  messages published before may have been missed): everything goes;
- it is older than ``cache_ttl_s``.

Nothing is cached while the inner directory says its invalidation channel is not held
(``invalidations_live()`` False, where it has one: a RedisDirectory whose ACL user may not
subscribe, or whose pub/sub connection is down): no invalidation would reach the entries.

Staleness is bounded, not excluded: an invalidation can be lost (Redis pub/sub is at-most-once) and
a node can die between two ``nodes()`` calls, so an entry may name a copy that is gone for up to
``cache_ttl_s``. That is safe: a read from a node that no longer holds the key is a clean miss
(NOT_FOUND), and bytes are verified against the location's checksum, so a stale entry costs a
retry on the next replica, never wrong bytes. Answers fetched while an invalidation arrived are
returned but not cached (the invalidation may concern them).

``leading`` answers from the cache when every key of the batch is cached fresh with a copy on a
node other than ``exclude``; otherwise it asks the inner directory.

Thread-safe: one lock guards the entries; the inner directory is called without it held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from store_backend.pool.directory import (
    DEFAULT_TOMBSTONE_TTL_S,
    Directory,
    Invalidation,
    Location,
    NodeInfo,
)

logger = logging.getLogger(__name__)


class CachedDirectory:
    """A Directory that caches ``inner``'s positive locate answers. Owns nothing but the cache:
    :meth:`close` unsubscribes and closes ``inner`` only when ``close_inner`` is True."""

    def __init__(self, inner: Directory, *, max_entries: int = 65536, cache_ttl_s: float = 5.0,
                 close_inner: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries!r}")
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s must be >= 0, got {cache_ttl_s!r}")
        self.inner = inner
        self._max_entries = int(max_entries)
        self._ttl_s = float(cache_ttl_s)
        self._close_inner = close_inner
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (deadline, every live location the inner directory returned (exclude=None), their nodes)
        self._entries: OrderedDict[str, tuple[float, list[Location], frozenset[str]]] = OrderedDict()
        self._inval_seq = 0  # bumped by every forget: an answer fetched across a bump is not cached
        self._dead: set[str] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._live: Callable[[], bool] | None = getattr(inner, "invalidations_live", None)
        self.hits = 0
        self.misses = 0

    # -- cache upkeep ----------------------------------------------------------------------------
    def _ensure_subscribed(self) -> None:
        if self._unsubscribe is not None:
            return
        with self._lock:
            if self._unsubscribe is not None:
                return
            self._unsubscribe = lambda: None  # placeholder: one subscription even if two threads race
        try:
            unsub = self.inner.subscribe(self.forget)
            on_gap = getattr(self.inner, "on_gap", None)  # RedisDirectory: the channel was (re)joined
            if on_gap is not None:
                unsub_keys, unsub_gap = unsub, on_gap(self.clear)

                def unsub() -> None:
                    unsub_keys()
                    unsub_gap()
        except BaseException:
            with self._lock:
                self._unsubscribe = None
            raise
        with self._lock:
            self._unsubscribe = unsub

    def forget(self, keys: Sequence[str]) -> None:
        """Drop ``keys``' entries (the invalidation callback; quick, never calls the directory)."""
        with self._lock:
            self._inval_seq += 1
            pop = self._entries.pop
            for key in keys:
                pop(key, None)

    def forget_node(self, node_id: str) -> None:
        with self._lock:
            self._inval_seq += 1
            stale = [k for k, (_, _, nodes) in self._entries.items() if node_id in nodes]
            for key in stale:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._inval_seq += 1
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups ---------------------------------------------------------------------------------
    def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
        self._ensure_subscribed()
        out: list[list[Location] | None] = [None] * len(keys)
        missing: list[int] = []
        with self._lock:
            now = self._clock()
            entries = self._entries
            for i, key in enumerate(keys):
                hit = entries.get(key)
                if hit is not None and hit[0] > now:
                    entries.move_to_end(key)
                    locs = hit[1]
                    out[i] = [loc for loc in locs if loc.node != exclude] if exclude in hit[2] else list(locs)
                else:
                    if hit is not None:
                        del entries[key]
                    missing.append(i)
            seq = self._inval_seq
            self.hits += len(keys) - len(missing)
            self.misses += len(missing)
        if missing:
            # Ask without `exclude`, so one entry serves every caller; filter here.
            fetched = self.inner.locate([keys[i] for i in missing])
            with self._lock:
                cache_it = (seq == self._inval_seq and self._max_entries > 0 and self._ttl_s > 0
                            and (self._live is None or self._live()))
                deadline = self._clock() + self._ttl_s
                for i, locs in zip(missing, fetched):
                    out[i] = [loc for loc in locs if loc.node != exclude] if exclude is not None else locs
                    if cache_it and locs:
                        self._entries[keys[i]] = (deadline, list(locs), frozenset(loc.node for loc in locs))
                        self._entries.move_to_end(keys[i])
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        return out  # type: ignore[return-value]

    def leading(self, keys: Sequence[str], *, exclude: str | None = None) -> int:
        self._ensure_subscribed()
        with self._lock:
            now = self._clock()
            entries = self._entries
            for hit in map(entries.get, keys):
                # A copy other than `exclude`'s: more than one holder, or the one is not `exclude`.
                if hit is None or hit[0] <= now or (len(hit[2]) == 1 and exclude in hit[2]):
                    break
            else:
                self.hits += len(keys)
                return len(keys)
        return self.inner.leading(keys, exclude=exclude)

    # -- nodes -----------------------------------------------------------------------------------
    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        known = self.inner.heartbeat(info, ttl_s)
        if not known:
            self.clear()  # the directory lost data (or this node is new): nothing cached holds
        return known

    def nodes(self) -> list[NodeInfo]:
        infos = self.inner.nodes()
        dead = {n.node_id for n in infos if not n.alive}
        with self._lock:
            newly_dead = dead - self._dead
            self._dead = dead
        for node_id in newly_dead:
            self.forget_node(node_id)
        return infos

    def deregister_node(self, node_id: str) -> None:
        self.forget_node(node_id)
        self.inner.deregister_node(node_id)
        self.forget_node(node_id)

    def address_of(self, node_ids: Sequence[str]) -> dict[str, str]:
        return self.inner.address_of(node_ids)

    def node_keys(self, node_id: str) -> list[str]:
        return self.inner.node_keys(node_id)

    # -- mutations: forget the keys before and after (a lookup racing the call must not re-cache) --
    def register(self, node_id: str, entries: Sequence[tuple[str, Location]], *, resync: bool = False,
                 stored_at_s: Sequence[float] | None = None) -> list[str]:
        keys = [k for k, _ in entries]
        self.forget(keys)
        try:
            return self.inner.register(node_id, entries, resync=resync, stored_at_s=stored_at_s)
        finally:
            self.forget(keys)

    def unregister(self, node_id: str, keys: Sequence[str]) -> None:
        self.forget(keys)
        try:
            self.inner.unregister(node_id, keys)
        finally:
            self.forget(keys)

    def put_start(self, node_id: str, keys: Sequence[str], sizes: Sequence[int], ttl_s: float, *,
                  stored_at_s: Sequence[float] | None = None) -> list[bool]:
        # pending marks are invisible: nothing cached changes
        return self.inner.put_start(node_id, keys, sizes, ttl_s, stored_at_s=stored_at_s)

    def put_end(self, node_id: str, entries: Sequence[tuple[str, Location]], *,
                stored_at_s: Sequence[float] | None = None) -> list[bool]:
        keys = [k for k, _ in entries]
        self.forget(keys)
        try:
            return self.inner.put_end(node_id, entries, stored_at_s=stored_at_s)
        finally:
            self.forget(keys)

    def put_abort(self, node_id: str, keys: Sequence[str]) -> None:
        self.inner.put_abort(node_id, keys)

    def remove(self, keys: Sequence[str], *, tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S) -> dict[str, list[str]]:
        self.forget(keys)
        try:
            return self.inner.remove(keys, tombstone_ttl_s=tombstone_ttl_s)
        finally:
            self.forget(keys)

    def restore_tombstones(self, keys: Sequence[str], removed_at_s: Sequence[float],
                           ttl_s: Sequence[float]) -> dict[str, list[str]]:
        # The keys whose tombstone came back had their locations dropped: forget them here too
        # (the invalidation may come later, or not at all). The others were not touched.
        got = self.inner.restore_tombstones(keys, removed_at_s, ttl_s)
        self.forget(list(got))
        return got

    def clear_node(self, node_id: str) -> int:
        self.forget_node(node_id)
        try:
            return self.inner.clear_node(node_id)
        finally:
            self.forget_node(node_id)

    def prune_dead(self, older_than_s: float) -> list[str]:
        pruned = self.inner.prune_dead(older_than_s)
        for node_id in pruned:
            self.forget_node(node_id)
        return pruned

    # -- invalidations and lifecycle -------------------------------------------------------------
    def subscribe(self, fn: Invalidation) -> Callable[[], None]:
        return self.inner.subscribe(fn)

    def close(self) -> None:
        with self._lock:
            unsub, self._unsubscribe = self._unsubscribe, None
            self._entries.clear()
        if unsub is not None:
            unsub()
        if self._close_inner:
            self.inner.close()
