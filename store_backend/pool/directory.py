"""The pool's directory: which node holds which object, which nodes are alive, where they listen.

One :class:`Directory` Protocol, two implementations beside it: ``EmbeddedDirectory`` (one
process, no server; the default, and what tests of one node use) in
:mod:`store_backend.pool.directory_embedded`, and ``RedisDirectory`` (redis-py against a real
Redis, Sentinel-addressed for HA) in :mod:`store_backend.pool.directory_redis`. Both pass one
contract suite (``tests/store_backend/pool/test_directory_contract.py``).

What a directory holds:

- per object key, its *locations*: one :class:`Location` per node holding it (the node's best
  local tier, the object's size and xxh3-64 checksum);
- per node, a :class:`NodeInfo` (its transport address, capacity, usage, hit counters for
  ``status``) and a *liveness* mark with a TTL, refreshed by :meth:`Directory.heartbeat`. A node
  whose mark expired is dead: lookups stop returning its locations at once (the check is made
  at lookup time, not by a sweeper), and :meth:`Directory.nodes` reports it ``alive=False``;
- per removed key, a *tombstone* holding ``removed_at_s``, the directory's own clock at the
  remove (Redis ``TIME`` inside the script; ``time.time()`` embedded), kept for
  ``tombstone_ttl_s``. A later put does not delete it; it only expires. A directory that lost
  its data gets them back from the nodes (:meth:`Directory.restore_tombstones`, fed by each
  node's :mod:`~store_backend.pool.remove_log`).

The remove rule (docs: notes REMOVE_RULE). Every registration path (:meth:`Directory.register`,
:meth:`Directory.put_start`, :meth:`Directory.put_end`) takes per entry ``stored_at_s``: the
wall-clock seconds at which the copy was committed on its node (0.0: unknown, e.g. a resync after
a restart, or a tier move whose commit time the caller does not know; ``None`` is 0.0 for every
entry; ``resync=True`` forces 0.0). Per entry, inside the one atomic batch:

1. the node already has a location for the key: accepted, as an update (tier, size, checksum);
2. else a tombstone exists and ``removed_at_s >= stored_at_s - clock_skew_s``: **refused**
   (register returns the key; put_start / put_end answer False);
3. else accepted.

``clock_skew_s`` (default :data:`DEFAULT_CLOCK_SKEW_S`) covers the clocks of different machines:
a refusal that was not needed costs a cache miss, never wrong bytes. A refused key is the
caller's to delete locally. So a node that was down during a remove, a registration in flight
during it, and a tier move of a copy the remove could not reach never list the old copy again.

Two-phase puts. A location becomes visible only in phase 2. A node registering what it already
committed locally (its residency events) calls :meth:`register` (phase 2 alone: the bytes are
there). A writer placing a replica on a peer calls :meth:`put_start` for the peer first (pending:
invisible to every lookup, expires after ``ttl_s`` if the writer dies), streams the bytes, and calls
:meth:`put_end` once the peer committed them. Every batch call is atomic (one Lua script in Redis,
one lock hold embedded): a reader sees all of a batch's locations or none of them, never a half.

Big batches. A Redis script holds the server until it ends, so RedisDirectory cuts every batch
into chunks of at most ``MAX_KEYS_PER_SCRIPT`` keys (one script call each): atomicity, and the
``op_timeout_s`` bound, hold per chunk; a register/unregister/remove batch larger than that is
applied chunk by chunk (a reader may see the first chunks before the last).

Lookups are batched: :meth:`locate` and :meth:`leading` answer a whole list of keys in one round
trip (one script call), never one per key.

Invalidations: :meth:`subscribe` delivers, on a thread owned by the directory (or synchronously,
embedded), the keys whose locations were dropped (unregister, remove, clear_node), so a node's
location cache (:mod:`store_backend.pool.cache`) forgets them. A delivery may be lost (Redis
pub/sub is at-most-once): the cache bounds every entry's age too, and a read from a node that no
longer holds the key is a clean miss, never wrong bytes (frames are checksummed against the
location's checksum).

Contract of every method: thread-safe; may block on the network (bounded by the directory's
``op_timeout_s``); raises :class:`DirectoryUnavailable` when the directory cannot be reached (the
caller treats the pool as a miss and keeps serving locally), ``ValueError`` for misuse. Node ids
and keys are text (keys as :func:`store_backend.types.check_key` allows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import msgspec

# A location's tier: the best copy the node holds (DRAM before SSD).
TIER_DRAM = "dram"
TIER_SSD = "ssd"
TIER_RANK = {TIER_DRAM: 0, TIER_SSD: 1}

# How long a removed key's tombstone refuses re-registration by a node that was down.
DEFAULT_TOMBSTONE_TTL_S = 24 * 3600.0
# How much the clocks of two machines may disagree (the remove rule refuses within it).
DEFAULT_CLOCK_SKEW_S = 1.0
# A node dead this long is forgotten by prune_dead (its locations, key set and info).
DEFAULT_DEAD_NODE_GC_S = 24 * 3600.0


MAX_TOMBSTONE_TTL_S = 366 * 24 * 3600.0  # a restored tombstone's ttl: a year at most


def check_tombstones(keys: Sequence[str], removed_at_s: Sequence[float], ttl_s: Sequence[float]) -> None:
    """The arguments of :meth:`Directory.restore_tombstones`: ValueError naming what is wrong."""
    if not len(keys) == len(removed_at_s) == len(ttl_s):
        raise ValueError(f"restore_tombstones: {len(keys)} keys, {len(removed_at_s)} removal times and "
                         f"{len(ttl_s)} ttls: one of each per key")
    for name, seq in (("removed_at_s", removed_at_s), ("ttl_s", ttl_s)):
        for i, v in enumerate(seq):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"restore_tombstones: {name}[{i}] must be a finite number of seconds, got {v!r}")
    for i, v in enumerate(ttl_s):
        if v > MAX_TOMBSTONE_TTL_S:
            raise ValueError(f"restore_tombstones: ttl_s[{i}] must be at most {MAX_TOMBSTONE_TTL_S:.0f} s, got {v!r}")


class DirectoryError(RuntimeError):
    """Base of the directory's own errors."""


class DirectoryUnavailable(DirectoryError):
    """The directory could not be reached or answered in time (Redis down, a failover under way).
    Nothing was changed that the caller must undo; it may retry later."""


class Location(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One node's copy of one object. ``gc=False``: its fields are text and ints, so it cannot be
    part of a reference cycle, and the collector need not track the many a lookup returns or a
    location cache holds (decoding a locate reply of 1024 keys: 15-30% faster in a micro-benchmark)."""

    node: str
    tier: str  # TIER_DRAM or TIER_SSD: the best copy on that node
    size: int  # bytes
    checksum: int = 0  # xxh3_64 of the bytes; 0: not recorded (a reader then relies on frame checksums)


class TierUsage(msgspec.Struct, frozen=True):
    objects: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0


class NodeInfo(msgspec.Struct, frozen=True):
    """What a node publishes about itself (refreshed with each heartbeat)."""

    node_id: str
    address: str  # "host:port" of its transport listener
    started_ns: int = 0  # this start of the node (a restart has a new one)
    capacity_bytes: int = 0  # DRAM + SSD
    used_bytes: int = 0
    tiers: dict[str, TierUsage] = msgspec.field(default_factory=dict)
    # Counters for `status` (hits, misses, bytes served, failures by kind): names as in /metrics.
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    alive: bool = True  # filled in by nodes(): the liveness mark was present

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)


Invalidation = Callable[[list[str]], None]


@runtime_checkable
class Directory(Protocol):
    # -- nodes -------------------------------------------------------------------------------------
    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        """Publish ``info`` and (re)set the node's liveness mark to expire in ``ttl_s``. Returns
        False when the directory did not know this node before this call (first start, its mark
        had expired, or the directory lost its data: a restarted empty Redis, a failover to a
        replica that missed writes): the caller must then re-register what it holds
        (:meth:`register` with ``resync=True``)."""
        ...

    def deregister_node(self, node_id: str) -> None:
        """A clean leave: the node's liveness mark and every location of it are dropped (and
        invalidated)."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """Every node the directory knows (alive or not: ``alive`` tells), sorted by node_id."""
        ...

    # -- placing objects ---------------------------------------------------------------------------
    def register(self, node_id: str, entries: Sequence[tuple[str, Location]], *, resync: bool = False,
                 stored_at_s: Sequence[float] | None = None) -> list[str]:
        """Record (or update: a new tier, a checksum) ``node_id``'s copies; one atomic batch.
        ``Location.node`` must equal ``node_id`` (ValueError). Clears a pending put_start of the
        same node. Each entry passes the remove rule (module docstring) with its ``stored_at_s``
        (one per entry; ``None``: 0.0 each; ValueError on a length mismatch); the refused keys are
        returned, in order, and the caller deletes its copies. Tombstones are never cleared here.
        ``resync`` True (re-registration after a restart or a directory loss) forces 0.0: every
        tombstoned key the node has no location for is refused."""
        ...

    def unregister(self, node_id: str, keys: Sequence[str]) -> None:
        """``node_id`` no longer holds ``keys`` (evicted, lost, removed locally); others' copies stay."""
        ...

    def put_start(self, node_id: str, keys: Sequence[str], sizes: Sequence[int], ttl_s: float, *,
                  stored_at_s: Sequence[float] | None = None) -> list[bool]:
        """Phase 1 of a replica write onto ``node_id``: mark each key pending there (invisible to
        lookups; expires after ``ttl_s``). Per key False when ``node_id`` already holds it, it is
        pending there already (another writer: do not send it), or the remove rule refuses it
        (``stored_at_s``: the source object's commit time, per key; ``None``: 0.0)."""
        ...

    def put_end(self, node_id: str, entries: Sequence[tuple[str, Location]], *,
                stored_at_s: Sequence[float] | None = None) -> list[bool]:
        """Phase 2: the pending copies became visible, all of the batch at once. Per key False
        when its pending mark was gone (expired, aborted, removed) or the remove rule refuses it
        (``stored_at_s`` as in put_start): nothing recorded for it, its pending mark dropped."""
        ...

    def put_abort(self, node_id: str, keys: Sequence[str]) -> None:
        """Drop pending marks (the write failed)."""
        ...

    def remove(self, keys: Sequence[str], *, tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S) -> dict[str, list[str]]:
        """Pool-wide remove: tombstone each key, drop every location of it (invalidated) and
        return, per key that had any, the node ids that held it (alive or not), so the caller
        deletes the copies on the live ones."""
        ...

    def restore_tombstones(self, keys: Sequence[str], removed_at_s: Sequence[float],
                           ttl_s: Sequence[float]) -> dict[str, list[str]]:
        """Put back tombstones the directory may have lost (a Redis restarted empty, a failover to
        a replica that missed writes), from a node's own record of the removes
        (:class:`~store_backend.pool.remove_log.RemoveLog`): per key, a tombstone with
        ``removed_at_s`` (wall-clock seconds: an upper bound, on the node's clock, of the
        directory's own time of the remove) that expires in ``ttl_s`` seconds. Only where the key
        has no tombstone (one that is there is the directory's own, or an earlier restore: kept
        as it is); a ``ttl_s`` of 0 or less sets nothing. A key whose tombstone is set this way is
        treated as a remove treats it: its pending marks and locations are dropped (invalidated),
        since a copy listed since the loss may be one the remove should have refused. Returns,
        per key whose tombstone was set, the nodes whose locations were dropped (often none):
        the caller asks them to delete their copies. ValueError for sequences of different
        lengths or a time that is not finite. Chunked as every batch call is (atomic per
        chunk)."""
        ...

    def clear_node(self, node_id: str) -> int:
        """Drop every location of ``node_id`` (before a restarted node re-registers); returns how
        many."""
        ...

    def prune_dead(self, older_than_s: float) -> list[str]:
        """Forget every node whose liveness mark expired at least ``older_than_s`` ago: its
        locations (invalidated), key set, info and mark, as :meth:`deregister_node` does. Returns
        the node ids forgotten, sorted. Idempotent; any node may call it (the registrar's heartbeat
        does, with ``DirectoryConfig.dead_node_gc_s``); a forgotten node that comes back is new
        (its heartbeat answers False and it resyncs)."""
        ...

    # -- lookups -----------------------------------------------------------------------------------
    def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
        """Per key, the copies on live nodes (never ``exclude``), best first: DRAM before SSD,
        then by node id. One round trip."""
        ...

    def leading(self, keys: Sequence[str], *, exclude: str | None = None) -> int:
        """How many of ``keys``, from the first, have a copy on a live node other than
        ``exclude`` (a prefix lookup). One round trip; stops at the first miss."""
        ...

    def node_keys(self, node_id: str) -> list[str]:
        """Every key ``node_id`` has a location for (alive or not)."""
        ...

    def address_of(self, node_ids: Sequence[str]) -> dict[str, str]:
        """Transport addresses of the live ones among ``node_ids``."""
        ...

    # -- invalidations and lifecycle ---------------------------------------------------------------
    def subscribe(self, fn: Invalidation) -> Callable[[], None]:
        """Call ``fn(keys)`` with keys whose locations were dropped anywhere in the pool; returns
        the unsubscribe function. ``fn`` must be quick and never call back into the directory."""
        ...

    def close(self) -> None:
        """Stop the directory's threads and connections (idempotent)."""
        ...
