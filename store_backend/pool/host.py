"""The seams between the pool and the node's store.

:class:`PoolHost`: exactly the store methods the pool's pieces call (the registrar, the replicator,
the pool service). :class:`~store_backend.store.TieredStore` implements it. ``local_only`` (lease,
remove, tier_of): this node's tiers only, never the pool tier.

:class:`PeerView`: the store as the transport server serves it to peers: this node's tiers only
(a peer's request served here never fans out to the pool again), a pool-wide remove's ``before_s``
honoured. :func:`store_backend.pool.service.local_view` makes one of a ``PoolHost``.

``tests/store_backend/pool/test_pool_host.py`` holds the store, the view and the pool's modules to
these.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol, runtime_checkable

from store_backend.config import StoreConfig
from store_backend.metrics import StoreStats
from store_backend.residency import Subscriber
from store_backend.slots import Reservation, SegmentInfo, SlotLease
from store_backend.types import Status


@runtime_checkable
class PoolHost(Protocol):
    """What the pool asks of the store it sits beside (see :class:`~store_backend.store.TieredStore`
    for each method's contract)."""

    config: StoreConfig  # read for its limits (``max_object_bytes``)

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = 60.0, owner: int = 0, group: int | None = None,
                room_wait_s: float | None = 0.0) -> list[Reservation]: ...

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0,
               checksums: Sequence[int | None] | None = None) -> list[Status]: ...

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None: ...

    def lease(self, keys: Sequence[str], *, ttl_s: float = 60.0, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0, group: int | None = None,
              local_only: bool = False) -> list[SlotLease]: ...

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]: ...

    def reclaim(self, owner: int, keep: Collection[int] = (), *, gone: bool = False) -> tuple[int, int]: ...

    def remove(self, keys: Sequence[str], *, local_only: bool = False) -> list[Status]: ...

    def invalidate_reads(self, keys: Sequence[str]) -> None: ...

    def keys(self, prefix: str = "") -> list[str]: ...

    def size_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[int | None]: ...

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0,
               local_only: bool = False) -> int: ...

    def abandoned(self, key: str) -> bool: ...

    def tier_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[str | None]: ...

    def segment(self) -> SegmentInfo | None: ...

    def open_segment_fd(self) -> int: ...

    def subscribe(self, fn: Subscriber, on_gap: Callable[[], None] | None = None) -> Callable[[], None]: ...

    def residency_seq(self) -> int: ...

    def stats(self) -> StoreStats: ...


@runtime_checkable
class PeerView(Protocol):
    """What the transport server asks of the store it serves to peers (see
    :func:`store_backend.pool.service.local_view`): the slot calls and the segment, reads and
    removes of this node's tiers only."""

    config: StoreConfig

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = 60.0, owner: int = 0, group: int | None = None,
                room_wait_s: float | None = 0.0) -> list[Reservation]: ...

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0,
               checksums: Sequence[int | None] | None = None) -> list[Status]: ...

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None: ...

    def lease(self, keys: Sequence[str], *, ttl_s: float = 60.0, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0, group: int | None = None) -> list[SlotLease]: ...

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]: ...

    def reclaim(self, owner: int, keep: Collection[int] = ()) -> tuple[int, int]: ...

    def remove(self, keys: Sequence[str], before_s: float = 0.0) -> list[Status]: ...

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0,
               local_only: bool = False) -> int: ...

    def abandoned(self, key: str) -> bool: ...

    def size_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[int | None]: ...

    def segment(self) -> SegmentInfo | None: ...

    def open_segment_fd(self) -> int: ...
