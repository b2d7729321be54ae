"""Host-DRAM tier: one page-aligned arena carved by the offset allocator, with an object index.

Owned by the store. Bookkeeping methods are not thread-safe: the store calls them under its lock.
Copies into and out of the arena happen outside that lock, on entries the store has reserved
(``WRITING``) or leased (``leases > 0``): such an entry is never evicted, freed or overwritten.
"""

from __future__ import annotations

import enum
import mmap
import os
import time
from collections.abc import Callable

from store_backend.allocator import OffsetAllocator
from store_backend.config import ConfigError, DramConfig
from store_backend.policies.base import EvictionPolicy
from store_backend.policies.registry import make_policy

SHM_DIR = "/dev/shm"


class EntryState(enum.Enum):
    WRITING = 1  # reserved, bytes being copied in; invisible to readers
    READY = 2


class Entry:
    __slots__ = ("key", "offset", "size", "state", "leases", "persisted", "declined", "offload_failures",
                 "offload_queued", "pins", "pin_deadline", "parent")

    def __init__(self, key: str, offset: int, size: int, parent: str | None) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.state = EntryState.WRITING
        self.leases = 0  # readers copying out right now
        self.persisted = False  # a durable copy exists in the tier below
        self.declined = False  # the tier below's admission policy refused it: nothing to write
        self.offload_failures = 0  # failed (or refused) attempts to write it to the tier below
        self.offload_queued = False  # waiting in the offload queue
        self.pins = 0  # leases held for in-flight loads (store.pin)
        self.pin_deadline = 0.0
        self.parent = parent

    @property
    def clean(self) -> bool:
        """Nothing is lost by dropping it: it is on the tier below, or that tier did not want it."""
        return self.persisted or self.declined

    def evictable(self, now: float) -> bool:
        return (
            self.state is EntryState.READY
            and self.leases == 0
            and (self.pins == 0 or now > self.pin_deadline)
        )


class Arena:
    """The mapped bytes: anonymous private memory, or a named /dev/shm segment."""

    def __init__(self, capacity_bytes: int, shm_name: str | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.shm_path = None if shm_name is None else os.path.join(SHM_DIR, shm_name)
        if self.shm_path is None:
            self._mmap = mmap.mmap(-1, capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, capacity_bytes)
                self._mmap = mmap.mmap(fd, capacity_bytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds an exported view; the mapping is released when that view dies.
            pass
        if self.shm_path is not None:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass


class HostDramTier:
    """Index + allocator + eviction policy over one arena."""

    def __init__(self, cfg: DramConfig, policy: EvictionPolicy | None = None) -> None:
        self.cfg = cfg
        if policy is None:
            try:
                policy = make_policy(cfg.eviction_policy)
            except ValueError as e:
                raise ConfigError(f"dram.eviction_policy: {e}") from None
        self.policy = policy
        self.arena = Arena(cfg.capacity_bytes, cfg.shm_name)
        self.allocator = OffsetAllocator(cfg.capacity_bytes, cfg.alignment_bytes)
        self.entries: dict[str, Entry] = {}

    # -- queries ---------------------------------------------------------------------------------
    def ready(self, key: str) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.state is EntryState.READY else None

    def view(self, entry: Entry) -> memoryview:
        return self.arena.view[entry.offset:entry.offset + entry.size]

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity

    # -- reservation and eviction ----------------------------------------------------------------
    def fits_ever(self, size: int) -> bool:
        return size <= self.allocator.capacity

    def reserve(
        self,
        key: str,
        size: int,
        parent: str | None,
        evict_ok: Callable[[Entry], bool],
        on_evict: Callable[[Entry], None],
    ) -> Entry | None:
        """Allocate a WRITING entry for ``key``, evicting victims the policy names if needed.

        ``evict_ok`` narrows which READY, unleased entries may go (e.g. only persisted ones);
        ``on_evict`` is told about each victim before it is freed. Returns None when no room can be
        made: never blocks.
        """
        offset = self.allocator.allocate(size)
        if offset is None:
            now = time.monotonic()

            def can_evict(k: str) -> bool:
                e = self.entries.get(k)
                return e is not None and e.evictable(now) and evict_ok(e)

            # Free space may be fragmented, so evict in policy order and retry after each victim;
            # every round frees at least one entry, so this ends.
            while offset is None:
                victims = self.policy.victims(size, can_evict)
                if not victims:
                    return None
                for victim in victims:
                    on_evict(self.entries[victim])
                    self.drop(victim)
                    offset = self.allocator.allocate(size)
                    if offset is not None:
                        break
        entry = Entry(key, offset, size, parent)
        self.entries[key] = entry
        return entry

    def commit(self, entry: Entry) -> None:
        entry.state = EntryState.READY
        self.policy.on_insert(entry.key, self.allocator.size_of(entry.offset), entry.parent)

    def drop(self, key: str) -> Entry | None:
        """Forget ``key`` and free its bytes (the caller checked it is not leased)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.allocator.free(entry.offset)
        if entry.state is EntryState.READY:
            self.policy.on_remove(key)
        return entry

    def close(self) -> None:
        self.entries.clear()
        self.arena.close()
