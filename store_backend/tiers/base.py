"""The seam below DRAM: one :class:`Tier` Protocol for every tier under the host arena.

``TieredStore`` keeps the DRAM arena itself (its operations are bookkeeping under the store lock,
with copies outside it) and an ordered list of lower tiers behind this Protocol: the SSD tier
today (:class:`store_backend.tiers.ssd.SsdTier`), a pooled tier across nodes later. Each tier has a
``name`` ("ssd", "pool"), the key of its stats and the ``tier`` label of its metrics, and
``traits`` that say how the store may rely on it.

Contract of every method: it may block (disk I/O, a network round trip), it is thread-safe, and
the store calls it with **no store lock held**. Outcomes are per key, as data (statuses, read
results, ``None``); exceptions are for misuse and a broken tier. Buffers are the caller's: a tier
copies from them (``put``) or into them (``get_into``) before it returns and keeps no reference.
Evictions a tier makes on its own are reported through ``set_eviction_listener`` as
:class:`store_backend.ssd.base.SsdBackend` describes (once per object, synchronously when the
object leaves the tier's index, possibly with the tier's lock held, before the ``put`` that
evicted returns; never for ``remove``). The listener only does in-memory work and never calls
back into the tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from store_backend.metrics import FailureCounters
from store_backend.types import Buffer, ReadResult, Status


class TierTraits(msgspec.Struct, frozen=True):
    backs_dram: bool  # a copy here makes the DRAM copy clean (ssd: True; a pool: False)
    durable: bool  # survives this process
    exclusive: bool  # only this store changes it: its eviction reports are complete (shared ssd: False)
    local_index: bool  # contains/size_of answer from memory (a pool: False; put's EXISTS check skips it)


class TierGauges(msgspec.Struct):
    """A tier's gauges as it reports them (its own eviction count included)."""

    objects: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    evictions: int = 0
    # A tier that tells its failures apart better than its read statuses do (the pool: peer gone,
    # timeout, directory ...) reports them here, and the store reports these instead of its own
    # count by status; None: the store's count stands.
    failures: FailureCounters | None = None
    # Likewise a tier that counts every object read from it itself (the pool: reads for gets,
    # stage-ins and a pin's promotions alike) reports them; None: the store's count of gets stands.
    hits: int | None = None
    bytes_read: int | None = None
    # Keys of removes the tier still owes a retry (the pool: peers holding them did not confirm).
    owed_removes: int = 0


@runtime_checkable
class Tier(Protocol):
    name: str
    traits: TierTraits

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]: ...

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]: ...

    def contains(self, keys: Sequence[str]) -> list[bool]: ...

    def size_of(self, keys: Sequence[str]) -> list[int | None]: ...

    def remove(self, keys: Sequence[str]) -> list[Status]: ...

    def keys(self) -> Iterator[str]: ...

    def gauges(self) -> TierGauges: ...

    def extra_stats(self) -> dict[str, int]: ...

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None: ...

    def close(self) -> None: ...
