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
- **Slots** (``reserve``/``commit``/``abort``, ``lease``/``release``, ``reclaim``): a caller may copy
  bytes into or out of the store's DRAM arena itself (one copy between the arena and an engine's
  pages; across processes through the node service's shared segment). A reserved key is invisible
  to every reader (``get_into``, ``lease``, ``contains``, ``exists``) until ``commit`` returns OK;
  a second ``reserve`` or ``put`` of it answers EXISTS. A lease keeps the object's bytes from
  eviction and overwrite until ``release``; a ``remove`` meanwhile takes the key at once and the
  last releaser frees the bytes. Every token has an owner (``owner``, default 0) and a TTL that
  bounds its *result*: a commit after it answers IO_ERROR, a release after it answers False (the
  read is void); a reservation's bytes stay held until the owner commits, aborts, or
  ``reclaim(owner)`` runs, so a slot is never reused while a live process may still write it. A
  token unknown, used, or another owner's answers IO_ERROR/False with no effect. Per share at most
  ``max_held_fraction`` (0.5) of the arena, counted in whole allocator blocks, and 65536 tokens
  (beyond: NO_SPACE; one object larger than that share: TOO_LARGE, permanent). The embedded store's
  share is the owner's (or a ``group`` of owners); the node service's is the client process's (all
  of a NodeClient's owners, its puts and gets, and its pins), and it keeps a process's tokens until
  the process ends them or exits (docs/NODE.md, "Slots, and when their memory is reused").
- **Lookups across shards**: ``exists_all`` answers the shortest leading run over several key lists
  (one round trip for all TP ranks); ``exists(..., count_reserved=True)`` counts saves in flight,
  ``exists(..., wait_s=S)`` waits up to S seconds for the keys to be committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from store_backend.metrics import StoreStats
from store_backend.slots import Reservation, SegmentInfo, SlotLease
from store_backend.types import Buffer, FlushReport, ReadResult, Status

__all__ = ["KVStore", "Reservation", "SegmentInfo", "SlotLease", "StoreClosedError"]


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

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0) -> int:
        """How many leading keys are stored (for prefix-chained keys: the reusable prefix length).
        ``count_reserved``: keys reserved and not committed yet count too. ``wait_s`` > 0: when not
        all are stored, block up to ``wait_s`` for commits until they are; the answer is what is
        stored then. ``wait_s`` outside [0, ``MAX_PIN_TTL_S``]: ``ValueError``."""
        ...

    def exists_all(self, key_lists: Sequence[Sequence[str]], *, count_reserved: bool = False) -> int:
        """The shortest leading run of stored keys over ``key_lists`` (0 for no lists), in one call."""
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

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = 60.0, owner: int = 0) -> list[Reservation]:
        """A writable arena slot of ``sizes[i]`` bytes per key (``Reservation.view``, at
        ``offset`` in the segment), to fill and then ``commit``; per key OK, EXISTS (stored or
        reserved already), INVALID_KEY, TOO_LARGE (permanent; also an object larger than one
        owner's share), NO_SPACE (nothing evictable, or the owner's share is held). Invisible to
        readers until committed. Never blocks on I/O."""
        ...

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0) -> list[Status]:
        """Make reserved objects visible; per reservation OK (also when a remove came in between:
        the bytes are dropped, as a put answers), IO_ERROR (TTL passed: nothing stored; or a
        token unknown/used/another owner's: no effect), or the reservation's own failed status.
        A committed object is covered by a later ``flush`` and offloaded as a put is."""
        ...

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None:
        """Give reserved slots back unstored (a foreign or used token: no effect)."""
        ...

    def lease(self, keys: Sequence[str], *, ttl_s: float = 60.0, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0) -> list[SlotLease]:
        """A read-only view of each stored object's bytes (``SlotLease.view``), stable until
        ``release``; per key OK, NOT_FOUND (absent, still being written, removed during a
        stage-in), INVALID_KEY, TOO_LARGE (permanent: larger than one owner's share; read it with
        ``get_into``, or treat it as a miss), NO_SPACE (no clean room to stage it in; the owner's share held),
        CORRUPT/IO_ERROR (a stage-in read failed). ``stage_in``: an object only in a lower tier
        is read into a slot first (blocks on that read). ``wait_pending_s`` > 0: a key being
        written is waited for (abort or expiry meanwhile: NOT_FOUND)."""
        ...

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]:
        """Give leases back; True per lease when its bytes were stable for the whole lease (what
        was read may be used), False when its TTL had passed or the token is not this owner's
        live lease (the read is void)."""
        ...

    def reclaim(self, owner: int) -> tuple[int, int]:
        """End every token ``owner`` holds (its connection or process ended): (reservations
        aborted, leases released)."""
        ...

    def host_mapping(self) -> memoryview | None:
        """The whole host mapping (the embedded arena, or this process's mapping of the node
        service's segment) that every ``Reservation.view`` and ``SlotLease.view`` handed out now
        lies in, or None when there is none (not connected yet). Optional for a store without
        slots; an engine's worker uses it once to register the mapping with CUDA (pinned), so a
        layer's copy between a slot and the GPU is one DMA. The view is a borrow: it stays valid
        until ``close`` (node: until the service restarts with another segment; slot views of the
        new one then lie outside it, and the caller checks). Never blocks; thread-safe."""
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
