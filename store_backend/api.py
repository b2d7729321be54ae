"""The one store interface both engine plugins use: :class:`KVStore`, and :class:`StoreClosedError`.

Callers (the vLLM worker and its lookup service, the SGLang HiCache backend, the connector's
:class:`~mooncake_connector.client.KVClient`, the epoch sweeper, the store registry in
:mod:`mooncake_connector.stores`) program against this Protocol only, so an embedded
:class:`~store_backend.store.TieredStore` and a client of a node service that every engine process
on the machine shares can stand in for each other. One contract suite
(``tests/store_backend/test_store_contract.py``, fixture ``make_store``) runs against every
implementation.

Contract shared by every method unless it says otherwise:

- **Thread-safety**: every method may be called from any thread, concurrently.
- **Blocking**: every call is synchronous; it returns when its effect is done (bytes copied, the
  object visible or gone). Calls that may wait on an SSD or another process say so.
- **Per-key outcomes are data**: a batch call answers one value per key, in the keys' order; a
  problem with one key (missing, corrupt, no room, a bad key) is that key's value and never an
  exception. Exceptions are for misuse (a read-only buffer, mismatched lengths, a TTL out of range:
  ``TypeError``/``ValueError`` naming the argument, raised before anything is done) and for a closed
  store (:class:`StoreClosedError`).
- **Buffers stay the caller's**: the store never keeps a reference to a caller's buffer after the
  call returns. ``put`` has copied the bytes out when it returns (the buffer may be reused at once);
  ``get_into`` has copied them in when it returns.
- **Immutable objects**: a key, once stored, keeps its bytes until it is removed or evicted; a second
  ``put`` of it answers ``EXISTS`` and keeps the stored bytes. A reader never sees a half-written
  object, and never sees a removed one after ``remove`` returned.
- **Closed**: once ``close()`` has begun, every method but ``close()``, ``note_stuck_threads`` and
  ``note_worker_error`` raises :class:`StoreClosedError`.

Next (not part of the Protocol yet, added with the slot API and the node service): ``exists_all``
(the shortest leading run over several key lists, one round trip for all TP ranks),
``exists(..., count_reserved=..., wait_s=...)``, and the slot methods ``reserve``/``commit``/``abort``/
``lease``/``release``/``reclaim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from store_backend.metrics import StoreStats
from store_backend.types import Buffer, FlushReport, ReadResult, Status


class StoreClosedError(RuntimeError):
    """A call on a store after ``close()`` began."""


@runtime_checkable
class KVStore(Protocol):
    """A key → immutable bytes store with per-key outcomes (see the module docstring for the
    contract every method shares)."""

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer],
            parents: Sequence[str | None] | None = None) -> list[Status]:
        """Store ``buffers[i]`` under ``keys[i]``; one status per key: OK, EXISTS (already stored;
        the stored bytes are kept), NO_SPACE, TOO_LARGE, INVALID_KEY, IO_ERROR. ``parents[i]`` names
        the key's prefix parent (None for a root), for prefix-aware eviction. The bytes have been
        copied out of every buffer when this returns; a key becomes visible to readers only once
        its whole object is stored."""
        ...

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy each object into the caller's writable ``buffers[i]``; per key OK (with the
        object's size), NOT_FOUND, BUFFER_TOO_SMALL (with the object's size; nothing copied),
        CORRUPT (a miss: never returned as bytes), INVALID_KEY, IO_ERROR. A read-only buffer is
        ``TypeError`` before anything is read. May block on an SSD read."""
        ...

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored in some tier (an object still being written is not)."""
        ...

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (for prefix-chained keys: the reusable prefix length)."""
        ...

    def tier_of(self, keys: Sequence[str]) -> list[str | None]:
        """The name of the fastest tier holding each key ("dram", "ssd"), or None."""
        ...

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        """Each object's size in bytes, or None when it is stored nowhere."""
        ...

    def keys(self, prefix: str = "") -> list[str]:
        """Every stored key starting with ``prefix``, each once: a snapshot, O(objects)."""
        ...

    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Delete objects from every tier; per key OK, NOT_FOUND, INVALID_KEY, IO_ERROR. Blocks
        until lower-tier copies are deleted: after OK or NOT_FOUND no copy is left for a restart
        to bring back. A reader in the middle of a copy finishes it; later reads miss."""
        ...

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]:
        """Keep objects from eviction for a coming load, until ``unpin`` or ``ttl_s`` passes (so a
        crashed caller cannot pin forever); presence per key. Pins are counted per key and may be
        released by another process than the one that took them. ``ttl_s`` outside
        (0, ``MAX_PIN_TTL_S``]: ``ValueError`` naming it."""
        ...

    def unpin(self, keys: Sequence[str]) -> None:
        """Release one pin per key taken by ``pin`` (a pin on an object removed since releases
        nothing, even when the key was stored again)."""
        ...

    def flush(self, timeout_s: float | None = None) -> bool:
        """Persist what is held in volatile tiers; True only when every object put before the call
        that the admission policy accepts is persisted. Blocking, bounded by ``timeout_s``."""
        ...

    def flush_report(self, timeout_s: float | None = None) -> FlushReport:
        """:meth:`flush`, saying which objects are not persisted, and why."""
        ...

    def stats(self) -> StoreStats:
        """A typed copy of every counter, with the gauges as they are now."""
        ...

    def metrics(self) -> dict[str, Any]:
        """:meth:`stats` as a plain nested dict (a copy), for logs and tests."""
        ...

    def note_stuck_threads(self, count: int) -> None:
        """Count ``count`` threads of the store's users still running when their close() reached its
        deadline (in ``store.thread_join_timeouts``). Works after close."""
        ...

    def note_worker_error(self) -> None:
        """Count one exception that escaped a background thread of the store's users (in
        ``store.worker_errors``). Works after close."""
        ...

    def close(self, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Close the store: blocking, idempotent, bounded by ``timeout_s`` as a whole. New calls
        raise :class:`StoreClosedError` from the moment it begins; calls already running finish
        first. With ``flush``, what ``flush()`` promises is persisted first."""
        ...
