"""Host-DRAM tier: one page-aligned arena carved by the offset allocator, with an object index.

Owned by the store. Bookkeeping methods are not thread-safe: the store calls them under its lock.
Copies into and out of the arena happen outside that lock, on entries the store has reserved
(``WRITING``) or leased (``leases > 0``): such an entry is never evicted, freed or overwritten.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from store_backend.allocator import OffsetAllocator
from store_backend.config import ConfigError, DramConfig
from store_backend.ownership import HeldLock, flock_or_raise
from store_backend.private import NotPrivateError, check_private_fd, open_private
from store_backend.policies.base import EvictionPolicy
from store_backend.policies.registry import make_policy

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class EntryState(enum.Enum):
    WRITING = 1  # reserved, bytes being copied in; invisible to readers
    READY = 2


class Entry:
    __slots__ = ("key", "offset", "size", "state", "leases", "persisted", "declined", "offload_failures",
                 "offload_queued", "pins", "pin_deadline", "parent", "put_seq", "freed", "replica", "checksum")

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
        self.put_seq = 0  # the store's number of the put that stored it (0: not numbered)
        self.freed = False  # its block went back to the allocator (it may belong to another entry now)
        self.replica = False  # a copy read from another node (the pool): dropping it loses nothing
        # object_checksum(key, bytes) of what was written, when the store keeps checksums (its arena
        # is shared: readers in other processes verify what they copied); None otherwise.
        self.checksum: int | None = None

    @property
    def clean(self) -> bool:
        """Nothing is lost by dropping it: it is on the tier below, that tier did not want it, or
        it is a copy of another node's object."""
        return self.persisted or self.declined or self.replica

    def evictable(self, now: float) -> bool:
        return (
            self.state is EntryState.READY
            and self.leases == 0
            and (self.pins == 0 or now > self.pin_deadline)
        )


@dataclass(frozen=True, slots=True)
class EntryFacts:
    """A copy of one DRAM entry's bookkeeping, taken under the store lock: what it says stays true
    only until the next call that changes the entry. For tools and tests that observe residency
    (it holds no reference into the index, so reading it never races the store)."""

    key: str
    size: int  # the object's bytes
    parent: str | None  # the key stored before it in its prefix chain (put's ``parents``)
    block_bytes: int  # arena bytes its block takes (what the allocator handed out)
    ready: bool  # committed and visible to readers (False: a write still copying in)
    persisted: bool  # a durable copy exists in the tier below
    declined: bool  # the tier below's admission refused it: nothing to write
    replica: bool  # a copy of another node's object
    leases: int  # leases held on it now (readers, slot leases, SSD writes in flight)
    pins: int  # pins held on it (store.pin)
    offload_failures: int  # failed or refused attempts to write it below

    @property
    def clean(self) -> bool:
        """Nothing is lost by dropping it (as :attr:`Entry.clean`)."""
        return self.persisted or self.declined or self.replica


@dataclass(frozen=True, slots=True)
class DramSnapshot:
    """The DRAM index at one moment (one lock hold): the allocator's used bytes and a copy of
    each entry asked for, by key. Read-only; see ``TieredStore.dram_snapshot``."""

    used_bytes: int
    capacity_bytes: int
    entries: dict[str, EntryFacts]


def unlink_leftover_segments(shm_name: str) -> None:
    """Unlink every fresh segment ``<shm_name>-<digits>`` in /dev/shm of this user whose lock is
    free: its owner died (a live owner holds its lock, and its segment is left alone; so is every
    segment of another user). What a fresh arena does
    before it makes its own; also for whoever ran owners that were killed (tests, scripts)."""
    prefix = shm_name + "-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        names = []
    for name in names:
        if not name.startswith(prefix) or not name[len(prefix):].isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue  # another user's (root can open it): never ours to unlink
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner holds it
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    os.unlink(path)
                    logger.info("unlinked %s, a segment left by an owner that exited", path)
            except OSError:
                pass
        finally:
            os.close(fd)


class Arena:
    """The mapped bytes: anonymous private memory, or a named /dev/shm segment.

    A named segment is locked (see :mod:`store_backend.ownership`) before it is resized, so a
    second opener is refused without touching the owner's bytes, and its pages are allocated at
    open (``posix_fallocate``): an arena that does not fit /dev/shm, alone or beside the segments
    of other ranks, is refused with :class:`ConfigError` at open instead of dying of SIGBUS at the
    first write past the room. Every failure after the segment was made removes it again. A
    segment is made with O_EXCL, 0600; one that is there already (a crashed owner's) is reused
    only when it is this user's and neither group nor others may open it. A
    private arena is anonymous memory, mapped lazily as before.
    """

    def __init__(self, capacity_bytes: int, shm_name: str | None, *, fresh: bool = False) -> None:
        """``fresh``: a new segment every open, ``<shm_name>-<start_ns>`` (see :meth:`_fresh_name`),
        never a crashed owner's leftover, which a client of that owner may still map and write."""
        self.capacity_bytes = capacity_bytes
        if fresh and shm_name is None:
            raise ConfigError("dram.shm_name: a fresh shared segment needs a name; got None (a private arena)")
        if fresh and shm_name is not None:
            shm_name = self._fresh_name(shm_name)
        self.shm_path = None if shm_name is None else os.path.join(SHM_DIR, shm_name)
        self._lock: HeldLock | None = None
        if self.shm_path is None:
            try:
                self._mmap = mmap.mmap(-1, capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, OverflowError) as e:
                raise ConfigError(f"dram.capacity_bytes={capacity_bytes}: cannot map a private arena of that "
                                  f"size: {getattr(e, 'strerror', None) or e}") from None
        else:
            self._mmap = self._map_segment(capacity_bytes, shm_name or "")
        self.view = memoryview(self._mmap)

    @staticmethod
    def _fresh_name(shm_name: str) -> str:
        """``<shm_name>-<start_ns>``, after :func:`unlink_leftover_segments` of ``shm_name``.

        A killed owner's client may still map its segment: a fresh inode keeps that client's late
        writes out of the new owner's objects, and the unlink gives the leftover's pages back once
        the last such mapping closes."""
        unlink_leftover_segments(shm_name)
        return f"{shm_name}-{time.time_ns()}"

    def _open_segment(self, shm_name: str) -> int:
        """A read-write descriptor of the segment at ``shm_path``: one made here (O_EXCL, 0600
        whatever the umask), or the one there once it passed
        :func:`store_backend.private.check_private_fd` (this user's, no group or other access:
        another user's segment, which that user could read and write under the store, is refused
        and left as it is). -1 when the path vanished meanwhile (try again). Raises ConfigError
        (NotPrivateError naming the path, owner, mode and fix)."""
        path = self.shm_path
        assert path is not None
        field = f"dram.shm_name={shm_name!r}"
        try:
            return open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"{field}: cannot create {path}: {e.strerror}") from None
        fix = (f"remove it (rm {path}, as its owner or root; the store then makes its own) or choose another "
               "dram.shm_name")
        try:
            # O_NOFOLLOW: a symbolic link planted at the name is refused (ELOOP), never followed.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return -1
        except OSError as e:
            try:
                st = os.lstat(path)
            except OSError:
                raise ConfigError(f"{field}: cannot open {path}: {e.strerror}") from None
            mode = stat.S_IMODE(st.st_mode)
            raise NotPrivateError(f"{field}: {path} exists (owner uid {st.st_uid}, mode {mode:04o}) and cannot be "
                                  f"opened: {e.strerror}; {fix}", path, st.st_uid, mode) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{field}: {path} exists and is not a shared-memory segment; {fix}")
            check_private_fd(fd, path, field, fix)
        except BaseException:
            os.close(fd)  # not ours: leave it exactly as it is
            raise
        return fd

    def _map_segment(self, capacity_bytes: int, shm_name: str) -> mmap.mmap:
        assert self.shm_path is not None
        for _attempt in range(10):
            fd = self._open_segment(shm_name)
            if fd < 0:
                continue
            try:
                flock_or_raise(fd, self.shm_path, "dram.shm_name")
                # The owner unlinks before it unlocks: a lock won on a segment it just unlinked is
                # not the segment at the path any more; open again.
                same = os.fstat(fd).st_ino == os.stat(self.shm_path).st_ino
            except FileNotFoundError:
                same = False
            except BaseException:
                os.close(fd)  # not ours: leave the segment exactly as it is
                raise
            if same:
                break
            os.close(fd)
        else:
            raise ConfigError(f"dram.shm_name={shm_name!r}: {self.shm_path} keeps being replaced; cannot own it")
        # This descriptor holds the lock and nothing else; the mapping gets its own open file
        # (a mapping, and the descriptor mmap keeps, would otherwise hold the lock in a forked child).
        self._lock = HeldLock(fd)
        try:
            self._reserve(fd, capacity_bytes, shm_name)
            try:
                map_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise ConfigError(f"dram.shm_name={shm_name!r}: cannot reopen {self.shm_path}: {e.strerror}") from None
            try:
                return mmap.mmap(map_fd, capacity_bytes, flags=mmap.MAP_SHARED)
            except (OSError, OverflowError) as e:
                raise ConfigError(f"dram.capacity_bytes={capacity_bytes}: cannot map dram.shm_name={shm_name!r} "
                                  f"of that size: {getattr(e, 'strerror', None) or e}") from None
            finally:
                os.close(map_fd)  # mmap keeps its own duplicate
        except BaseException:
            self._release_segment()
            raise

    def _reserve(self, fd: int, capacity_bytes: int, shm_name: str) -> None:
        """Size the segment to ``capacity_bytes`` with every page allocated now.

        ``ftruncate`` alone reserves nothing on tmpfs: several segments (one per rank) could each
        pass a room check and together overrun /dev/shm, and the process would die of SIGBUS at
        the first write past the room. ``posix_fallocate`` takes the pages at open or fails with
        ENOSPC. It zero-fills them, so opening costs time in proportion to the arena (about 0.9 s
        per GiB measured on a busy 2-core host) and the pages count as used shared memory from the
        start: correctness over a fast open.
        """
        st = os.fstat(fd)
        vfs = os.statvfs(SHM_DIR)
        # Pages the segment already holds count as room: a leftover of a crashed owner is reused.
        # This check is only a snapshot (others allocate too); it saves zero-filling all of
        # /dev/shm before an ENOSPC in the plain case.
        room = vfs.f_bavail * vfs.f_frsize + st.st_blocks * 512
        if vfs.f_blocks and capacity_bytes > room:
            raise self._too_big(capacity_bytes, shm_name, room)
        try:
            if st.st_size > capacity_bytes:
                os.ftruncate(fd, capacity_bytes)  # a larger leftover of a crashed owner
            os.posix_fallocate(fd, 0, capacity_bytes)
        except (OSError, OverflowError) as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG):
                vfs = os.statvfs(SHM_DIR)
                raise self._too_big(capacity_bytes, shm_name, vfs.f_bavail * vfs.f_frsize) from None
            raise ConfigError(f"dram.capacity_bytes={capacity_bytes}: cannot size dram.shm_name={shm_name!r} "
                              f"to that: {getattr(e, 'strerror', None) or e}") from None

    @staticmethod
    def _too_big(capacity_bytes: int, shm_name: str, room: int) -> ConfigError:
        return ConfigError(
            f"dram.capacity_bytes={capacity_bytes} does not fit {SHM_DIR} for dram.shm_name={shm_name!r}: "
            f"{room} bytes are free there (a larger arena would crash the process with SIGBUS when it "
            f"fills); lower dram.capacity_bytes or make {SHM_DIR} larger")

    def _release_segment(self) -> None:
        """Unlink the segment, then drop the lock (in that order: a new owner may create it at once).

        In a forked child the lock was already closed (see :mod:`store_backend.ownership`): the
        child leaves the parent's segment alone."""
        if self.shm_path is not None and self._lock is not None and self._lock.fd >= 0:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
            self._lock.close()

    def identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the segment, or None for a private arena (or after close)."""
        if self._lock is None or self._lock.fd < 0:
            return None
        st = os.fstat(self._lock.fd)
        return st.st_dev, st.st_ino

    def open_segment_fd(self) -> int:
        """A new read-write descriptor of the segment (O_CLOEXEC), for passing to another process;
        the caller owns and closes it. It is a separate open file description, never the one that
        holds the lock (a receiver holding that would hold the lock). OSError when the arena is
        private or closed."""
        if self._lock is None or self._lock.fd < 0:
            raise OSError(errno.EBADF, "the arena is not a shared segment (or is closed)")
        return os.open(f"/proc/self/fd/{self._lock.fd}", os.O_RDWR | os.O_CLOEXEC)

    def close(self) -> None:
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds an exported view; the mapping is released when that view dies.
            pass
        self._release_segment()


class HostDramTier:
    """Index + allocator + eviction policy over one arena."""

    def __init__(self, cfg: DramConfig, policy: EvictionPolicy | None = None, *, fresh_segment: bool = False) -> None:
        self.cfg = cfg
        if policy is None:
            try:
                policy = make_policy(cfg.eviction_policy)
            except ValueError as e:
                raise ConfigError(f"dram.eviction_policy: {e}") from None
        self.policy = policy
        self.arena = Arena(cfg.capacity_bytes, cfg.shm_name, fresh=fresh_segment)
        try:
            self.allocator = OffsetAllocator(cfg.capacity_bytes, cfg.alignment_bytes)
        except BaseException:
            self.arena.close()
            raise
        self.entries: dict[str, Entry] = {}
        self.double_frees = 0  # blocks given back twice (a bug; see free)

    # -- queries ---------------------------------------------------------------------------------
    def ready(self, key: str) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.state is EntryState.READY else None

    def view(self, entry: Entry) -> memoryview:
        return self.arena.view[entry.offset:entry.offset + entry.size]

    def facts(self, entry: Entry) -> EntryFacts:
        """A copy of ``entry``'s bookkeeping (the caller holds the store lock)."""
        # A freed entry (a bug if still indexed) reports the block it would take, so books that sum
        # the index's blocks against the allocator's used bytes do not balance.
        block = self.block_bytes(entry.size) if entry.freed else self.allocator.size_of(entry.offset)
        return EntryFacts(entry.key, entry.size, entry.parent, block,
                          entry.state is EntryState.READY, entry.persisted, entry.declined, entry.replica,
                          entry.leases, entry.pins, entry.offload_failures)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity

    # -- reservation and eviction ----------------------------------------------------------------
    def fits_ever(self, size: int) -> bool:
        return size <= self.allocator.capacity

    def block_bytes(self, size: int) -> int:
        """Arena bytes an object of ``size`` bytes takes: whole alignment units, at least one
        (what the allocator hands out; what a slot counts against its owner's share)."""
        align = self.allocator.alignment
        return max(1, -(-size // align)) * align

    def free(self, entry: Entry) -> bool:
        """Give ``entry``'s block back to the allocator, once. False, freeing nothing, when it was
        given back already (or the allocator does not know it): a double free, a bug, counted in
        ``double_frees`` and logged. Freeing again could hand out a block another entry owns by
        now, so it is left alone."""
        if not entry.freed:
            entry.freed = True
            try:
                self.allocator.free(entry.offset)
                return True
            except KeyError:
                pass
        self.double_frees += 1
        logger.error("arena block of key %r at offset %d was freed already; left alone", entry.key, entry.offset)
        return False

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
        self.free(entry)
        if entry.state is EntryState.READY:
            self.policy.on_remove(key)
        return entry

    def close(self) -> None:
        self.entries.clear()
        self.arena.close()
