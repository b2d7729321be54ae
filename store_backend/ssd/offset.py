"""The offset-allocator SSD backend: one preallocated file, object-level allocation and eviction.

Layout of ``offset.data`` (``capacity_bytes`` long, preallocated)::

    block 0:   superblock (magic, per-file seed, size, checksum)
    block 1…:  records (see record.py) at 4 KiB-aligned offsets handed out by a free-extent
               allocator; space between records is free

Unlike Mooncake's offset backend, opening an existing file never truncates it: recovery walks the
file from the start, hopping from a valid header over its record and searching free space block by
block (skipping holes with SEEK_DATA), and serves every record found; the highest sequence number
wins for a key. This is sound because of two write-ordering rules:

- A header is written only after its value is durable (value writes, fdatasync, header writes,
  fdatasync), so a valid header always sits in front of a complete value: a torn put leaves no
  header and its space is simply free again after a restart.
- Space is reused only after the headers of the records that lived there (removed, evicted or
  found corrupt) are zeroed durably, so a stale header never hides a newer record from the walk
  and a removed object never comes back.

The file is preallocated at open to ``capacity_bytes``, or to what fits under ``disk_watermark`` of
the file system when that is less (a capacity larger than the whole file system is refused), so a
full disk cannot fail its writes. A data file with holes (a sparse copy) may still meet ENOSPC:
then records are evicted in order and the new ones written over their (allocated) space.

Headers are checked with a seed kept in the superblock, so a record-shaped value (or a record from
another file) is never taken for a header.

Thread-safe: reads run concurrently; puts, removes and the invalidation of corrupt records hold
one write lock in turn (they order writes to the shared file). A record being read is never
evicted, and ``remove`` of one answers BUSY.

The file's format and the pieces without I/O state (the superblock, the recovery scan and its
winners, the free-extent allocator) are :mod:`store_backend.ssd.offset_format`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from store_backend.config import ConfigError, SsdConfig
from store_backend.private import open_private
from store_backend.ssd.base import SsdStats
from store_backend.ssd.directory import direct_io_usable, fs_room, open_directory
from store_backend.ssd.indexed import IndexedBackend
from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.requests import ALIGN, IoRequest, align_down, aligned_buffer, fsync_dir
from store_backend.ssd.offset_format import (
    _ENOSPC_MAX_VICTIMS,
    _ENOSPC_RETRIES,
    _SUPER,
    _SUPER_MAGIC,
    _ZERO_BLOCK,
    DATA_START,
    FILE_NAME,
    FreeExtents,
    _Entry,
    _fallocate,
    decode_superblock,
    pick_winners,
    scan_records,
)
from store_backend.ssd.record import (
    HEADER_BLOCK,
    RecordRead,
    encode_header,
    read_records,
    record_bytes,
    status_for_errno,
    value_buffers,
    value_checksum,
)
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_batch, check_key

__all__ = ["DATA_START", "FILE_NAME", "OffsetBackend"]

logger = logging.getLogger(__name__)

class OffsetBackend(IndexedBackend):
    """See the module docstring. ``engine`` does the file I/O; closed by ``close()`` when owned."""

    name = "offset"

    def __init__(self, cfg: SsdConfig, engine: IoEngine, *, owns_engine: bool = False,
                 shared: bool = False) -> None:
        self.cfg = cfg
        self._engine = engine
        self._owns_engine = owns_engine
        self._dir = cfg.path
        if shared:
            raise ConfigError("ssd.backend='offset' cannot share its directory (only 'file' can)")
        self._owner = open_directory(cfg)
        self._path = os.path.join(self._dir, FILE_NAME)
        self._lock = threading.Lock()  # index, allocator, counters
        self._wlock = threading.Lock()  # one writer of the file at a time (see the module docstring)
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # eviction order: oldest/least recent first
        self._pending: set[str] = set()
        self._seq = 1
        self._stats = SsdStats()
        self._closed = False
        self._fd = -1
        self._sparse = False  # parts of the file may be holes: a write there can meet ENOSPC
        try:
            self._direct = direct_io_usable(cfg, self.name)
            self._seed, size = self._open_file()
            self._size = size
            self._stats.capacity_bytes = size - DATA_START
            self._fd = os.open(self._path, os.O_RDWR | (os.O_DIRECT if self._direct else 0))
            self._recover()
        except BaseException as e:
            if self._fd >= 0:
                os.close(self._fd)
            self._owner.release()
            if isinstance(e, OSError):
                raise ConfigError(f"ssd.path={self._dir!r}: cannot open the offset backend: {e}") from None
            raise

    # -- file and recovery ---------------------------------------------------------------------------
    def _target_size(self, allocated: int, existing: int = 0) -> int:
        """File bytes to preallocate: ``capacity_bytes``, or less where the file system has less
        room under ``disk_watermark`` (``allocated``: bytes the file already holds on disk).

        ``existing`` is the size of a data file being reopened: the answer is never below it and
        never raises (only growth is limited by the room; the file's records stay whole however
        full the disk is)."""
        want = align_down(self.cfg.capacity_bytes)
        st = os.statvfs(self._dir)
        total = st.f_blocks * st.f_frsize
        if existing:
            if want <= existing:
                return existing
            fits = self._room_bytes(st, allocated, want)
            if want > fits:
                logger.warning("ssd.capacity_bytes=%d does not fit the file system at %s under "
                               "ssd.disk_watermark=%.2f: the offset backend keeps its %d-byte file and grows "
                               "it to %d bytes", self.cfg.capacity_bytes, self._dir, self.cfg.disk_watermark,
                               existing, max(existing, fits))
            return max(existing, min(want, fits))
        if st.f_blocks and want > total:
            raise ConfigError(f"ssd.capacity_bytes={self.cfg.capacity_bytes} is larger than the whole file system "
                              f"holding ssd.path={self._dir!r} ({total} bytes)")
        # Never ask fallocate for more than is free: on ext4 a failed fallocate keeps what it got,
        # which would leave the file system full.
        fits = self._room_bytes(st, allocated, want)
        if want > fits:
            logger.warning("ssd.capacity_bytes=%d does not fit the file system at %s under ssd.disk_watermark=%.2f "
                           "(room for %d bytes): the offset backend uses %d bytes",
                           self.cfg.capacity_bytes, self._dir, self.cfg.disk_watermark, fits, fits)
            want = fits
        if want < 2 * ALIGN:
            raise ConfigError(f"ssd.capacity_bytes={self.cfg.capacity_bytes}: the file system at ssd.path={self._dir!r} "
                              f"has no room for it under ssd.disk_watermark={self.cfg.disk_watermark}")
        return want

    def _room_bytes(self, st: os.statvfs_result, allocated: int, want: int) -> int:
        """Aligned bytes the data file may hold on the file system ``st`` describes: the free space
        plus ``allocated`` (what the file holds already), kept under ``disk_watermark``; ``want``
        where the file system reports no size."""
        fits = st.f_bavail * st.f_frsize + allocated if st.f_blocks else want
        room = fs_room(self._dir, self.cfg.disk_watermark)
        if room is not None:
            used, limit = room
            fits = min(fits, limit - used + allocated)
        return align_down(max(0, fits))

    def _open_file(self) -> tuple[int, int]:
        try:
            os.unlink(self._path + ".tmp")  # a create that crashed (never renamed into place)
        except FileNotFoundError:
            pass
        if not os.path.exists(self._path):
            want = self._target_size(0)
            return self._create(want), want
        fd = os.open(self._path, os.O_RDWR)
        try:
            raw = os.pread(fd, _SUPER.size, 0)
            if len(raw) != _SUPER.size:
                raise ConfigError(f"ssd.path={self._dir!r}: {self._path} is too short for an offset-backend superblock")
            sb = decode_superblock(raw)
            if sb is None:
                raise ConfigError(f"ssd.path={self._dir!r}: {self._path} is not an offset-backend data file "
                                  "(bad superblock); it was left alone")
            seed = sb[0]
            st = os.fstat(fd)
            size = align_down(st.st_size)
            self._sparse = st.st_blocks * 512 < size
            want = self._target_size(st.st_blocks * 512, existing=size)
            if want > size:
                self._grow(fd, size, want)
                size = want
            elif align_down(self.cfg.capacity_bytes) < size:
                logger.info("%s is %d bytes, more than capacity_bytes=%d: keeping it whole (its records stay)",
                            self._path, size, self.cfg.capacity_bytes)
        finally:
            os.close(fd)
        return seed, size

    def _grow(self, fd: int, old: int, new: int) -> None:
        try:
            _fallocate(fd, old, new - old)
        except OSError as e:
            logger.warning("cannot preallocate %s (%s); the file stays sparse", self._path, e)
            self._sparse = True
            try:
                os.ftruncate(fd, new)
            except OSError as e2:
                raise ConfigError(f"ssd.capacity_bytes={self.cfg.capacity_bytes}: cannot size {self._path} to "
                                  f"{new} bytes: {e2.strerror}") from None
        os.fsync(fd)

    def _create(self, size: int) -> int:
        seed = secrets.randbits(64)
        tmp = self._path + ".tmp"
        fd = open_private(tmp, os.O_CREAT | os.O_TRUNC | os.O_RDWR)
        try:
            self._grow(fd, 0, size)
            head = _SUPER.pack(_SUPER_MAGIC, seed, size, 0)[:24]
            os.pwrite(fd, head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, self._path)
        fsync_dir(self._dir)
        return seed

    def _scan(self) -> list[tuple[int, int, int, bytes]]:
        """Walk the file: (offset, value_len, seq, key) of every record whose header is valid."""
        found, unreadable = scan_records(self._path, self._seed, self._size)
        self._stats.unreadable_files += len(unreadable)
        return found

    def _recover(self) -> None:
        found = self._scan()
        best, losers = pick_winners(found)
        for off, value_len, seq, key in sorted(best.values(), key=lambda r: r[2]):  # oldest first
            self._index[key.decode()] = _Entry(off, value_len, seq)
        if found:
            self._seq = max(r[2] for r in found) + 1
        used = [(e.offset - DATA_START, e.nbytes) for e in self._index.values()]
        self._alloc = FreeExtents(self._size - DATA_START, used)
        if losers:
            self._invalidate(losers)
        self._stats.recovered_objects = len(self._index)
        self._stats.discarded_records = len(losers)
        if found:
            logger.info("offset backend at %s: recovered %d objects (%d superseded records dropped)",
                        self._dir, len(self._index), len(losers))

    def _invalidate(self, offsets: list[int]) -> int:
        """Zero the header blocks at ``offsets`` durably; 0 or -errno."""
        if not offsets:
            return 0
        results = self._engine.write([IoRequest(self._fd, off, [_ZERO_BLOCK]) for off in offsets])
        bad = [r for r in results if r < 0]
        if bad:
            return bad[0]
        return self._engine.sync([self._fd])[0]

    # -- put ---------------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        """Write new objects; blocks until every object reported OK is durable. Thread-safe."""
        check_batch(keys, buffers)
        out = [Status.OK] * len(keys)
        views: dict[int, memoryview] = {}
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = Status.INVALID_KEY
                    continue
                v = byte_view(buffers[i])
                if record_bytes(v.nbytes) > self._stats.capacity_bytes:
                    out[i] = Status.TOO_LARGE
                elif key in self._index or key in self._pending:
                    out[i] = Status.EXISTS
                else:
                    self._pending.add(key)
                    views[i] = v
        if not views:
            return out
        try:
            with self._wlock:
                self._put_locked(keys, views, out)
        finally:
            with self._lock:
                self._pending.difference_update(keys[i] for i in views)
        return out

    def _put_locked(self, keys: Sequence[str], views: dict[int, memoryview], out: list[Status]) -> None:
        todo = views
        for attempt in range(_ENOSPC_RETRIES + 1):
            full = self._put_once(keys, todo, out, over_victims=attempt > 0)
            if not full or attempt == _ENOSPC_RETRIES:
                return
            # The file has holes and the file system is full: space that records were written to
            # is on disk, so evict by the eviction order and write over what the victims held.
            logger.warning("offset backend at %s: file system full (sparse %s); evicting to write %d objects",
                           self._dir, self._path, len(full))
            todo = {i: views[i] for i in full}

    def _victim_space(self, need: int) -> tuple[int | None, list[_Entry]]:
        """Under the lock: room for ``need`` bytes over records already written (so allocated on
        disk), for a sparse file on a full file system; (file-data offset reserved, or None, and
        the records evicted for it).

        Victims are picked first and evicted only when they cover ``need``: the oldest records in
        eviction order (at most ``_ENOSPC_MAX_VICTIMS``, none being read) are taken one by one
        until one extent, or a run of adjacent extents, holds ``need``; exactly that extent or run
        goes. When none does, nothing is evicted."""
        picked: list[tuple[str, _Entry]] = []
        by_start: dict[int, tuple[str, _Entry]] = {}
        by_end: dict[int, tuple[str, _Entry]] = {}
        window: list[tuple[str, _Entry]] | None = None
        for key in itertools.islice(self._index, _ENOSPC_MAX_VICTIMS):
            e = self._index[key]
            if e.readers:
                continue
            item = (key, e)
            picked.append(item)
            by_start[e.offset] = item
            by_end[e.offset + e.nbytes] = item
            window = self._run_window(item, by_start, by_end, need)
            if window is not None:
                break
        if window is None:
            return None, []
        victims = []
        self._note_evicted(key for key, _e in window)
        for key, e in window:
            del self._index[key]
            self._alloc.free(e.offset - DATA_START, e.nbytes)
            victims.append(e)
        start = window[0][1].offset - DATA_START
        if not self._alloc.reserve(start, need):  # cannot happen: the run was freed just now
            return None, victims
        return start, victims

    @staticmethod
    def _run_window(newest: tuple[str, _Entry], by_start: dict[int, tuple[str, _Entry]],
                    by_end: dict[int, tuple[str, _Entry]], need: int) -> list[tuple[str, _Entry]] | None:
        """The fewest adjacent picked extents, ``newest`` among them, that hold ``need`` bytes (in
        file order), or None. Earlier picks alone held no such run, so one must include ``newest``."""
        run = [newest]
        while run[0][1].offset in by_end:
            run.insert(0, by_end[run[0][1].offset])
        at = len(run) - 1  # newest's index in the run
        while run[-1][1].offset + run[-1][1].nbytes in by_start:
            run.append(by_start[run[-1][1].offset + run[-1][1].nbytes])
        best: tuple[int, int] | None = None
        for lo in range(at + 1):
            total = sum(e.nbytes for _k, e in run[lo:at])
            for hi in range(at, len(run)):
                total += run[hi][1].nbytes
                if total >= need:
                    if best is None or hi - lo < best[1] - best[0]:
                        best = (lo, hi)
                    break
        return None if best is None else run[best[0]:best[1] + 1]

    def _put_once(self, keys: Sequence[str], views: dict[int, memoryview], out: list[Status], *,
                  over_victims: bool) -> list[int]:
        """One write pass (``_wlock`` held); the batch indices whose write met a full file system."""
        placed: dict[int, int] = {}  # batch index -> file offset
        victims: list[_Entry] = []
        with self._lock:
            for i, v in views.items():
                need = record_bytes(v.nbytes)
                off = None
                if over_victims:
                    off, more = self._victim_space(need)
                    victims += more
                else:
                    off = self._alloc.allocate(need)
                while off is None and not over_victims:
                    # Oldest unread record first (the index is in insertion order); found without
                    # copying the index, which would cost O(objects) per put once the tier is full.
                    victim = next(((k, e) for k, e in self._index.items() if e.readers == 0), None)
                    if victim is None:
                        break
                    del self._index[victim[0]]
                    self._note_evicted((victim[0],))
                    victims.append(victim[1])
                    self._alloc.free(victim[1].offset - DATA_START, victim[1].nbytes)
                    off = self._alloc.allocate(need)
                if off is None:
                    out[i] = Status.NO_SPACE
                else:
                    placed[i] = off + DATA_START
            self._stats.evictions += len(victims)

        # Phase 0: the evicted records' headers go before their space is written over.
        err = self._invalidate([e.offset for e in victims])
        if err < 0:
            logger.error("invalidating %d evicted records failed: %s", len(victims), os.strerror(-err))
            with self._lock:
                for i, off in placed.items():
                    self._alloc.free(off - DATA_START, record_bytes(views[i].nbytes))
                for e in victims:  # their space stays out of use until a restart sorts it out
                    self._alloc.reserve(e.offset - DATA_START, e.nbytes)
            for i in placed:
                out[i] = status_for_errno(-err)
            return []

        # Phase 1: values (and padding), then fdatasync.
        order = [i for i in placed if views[i].nbytes]
        results = self._engine.write([IoRequest(self._fd, placed[i] + HEADER_BLOCK, value_buffers(views[i]))
                                      for i in order])
        failed = {i: r for i, r in zip(order, results) if r < 0}
        alive = [i for i in placed if i not in failed]
        if alive:
            r = self._engine.sync([self._fd])[0]
            if r < 0:
                failed.update((i, r) for i in alive)
                alive = []

        # Phase 2: headers, then fdatasync: from here on each record exists.
        headers = aligned_buffer(max(1, len(alive)) * HEADER_BLOCK)
        entries: dict[int, _Entry] = {}
        with self._lock:
            for i in alive:
                entries[i] = _Entry(placed[i], views[i].nbytes, self._seq)
                self._seq += 1
        requests = []
        for k, i in enumerate(alive):
            key_b = keys[i].encode()
            block = headers[k * HEADER_BLOCK:(k + 1) * HEADER_BLOCK]
            encode_header(block, key_b, views[i].nbytes, entries[i].seq, value_checksum(key_b, views[i]), self._seed)
            requests.append(IoRequest(self._fd, placed[i], [block]))
        for i, r in zip(alive, self._engine.write(requests)):
            if r < 0:
                failed[i] = r
        done = [i for i in alive if i not in failed]
        if done:
            r = self._engine.sync([self._fd])[0]
            if r < 0:
                failed.update((i, r) for i in done)
                done = []

        with self._lock:
            for i in done:
                self._index[keys[i]] = entries[i]
                out[i] = Status.OK  # a retry after a full file system may follow a NO_SPACE
            for i, r in failed.items():
                self._alloc.free(placed[i] - DATA_START, record_bytes(views[i].nbytes))
                out[i] = status_for_errno(-r)
        if failed:
            logger.warning("offset backend: %d of %d writes failed (%s)", len(failed), len(placed),
                           os.strerror(-next(iter(failed.values()))))
        return [i for i, r in failed.items() if -r in (errno.ENOSPC, errno.EDQUOT)]

    # -- get ---------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy objects into the caller's buffers, verifying each; CORRUPT ones are dropped."""
        check_batch(keys, buffers)
        out = [ReadResult(Status.NOT_FOUND)] * len(keys)
        reads: list[tuple[int, _Entry, RecordRead]] = []
        lru = self.cfg.bucket_eviction == "lru"
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = ReadResult(Status.INVALID_KEY)
                    continue
                e = self._index.get(key)
                if e is None:
                    continue
                dest = byte_view(buffers[i])
                if dest.nbytes < e.value_len:
                    out[i] = ReadResult(Status.BUFFER_TOO_SMALL)
                    continue
                e.readers += 1
                if lru:
                    self._index.move_to_end(key)
                reads.append((i, e, RecordRead(self._fd, e.offset, key.encode(), e.value_len, e.seq, dest)))
        if not reads:
            return out
        statuses = [Status.IO_ERROR] * len(reads)
        try:
            statuses = read_records(self._engine, [r for _, _, r in reads], self._seed)
        finally:
            zap: list[_Entry] = []
            with self._lock:
                for (i, e, r), st in zip(reads, statuses):
                    e.readers -= 1
                    if st is Status.CORRUPT and not e.dead:
                        e.dead = True
                        self._stats.corrupt_reads += 1
                        if self._index.get(keys[i]) is e:
                            del self._index[keys[i]]
                    if e.dead and e.readers == 0 and not e.zapped:
                        e.zapped = True
                        zap.append(e)
            if zap:
                logger.warning("%d corrupt records in %s dropped", len(zap), self._path)
                self._zap(zap)
        for (i, e, r), st in zip(reads, statuses):
            out[i] = ReadResult(st, r.value_len if st is Status.OK else 0)
        return out

    def _zap(self, entries: list[_Entry]) -> None:
        """Invalidate corrupt records on disk, then give their space back."""
        with self._wlock:
            err = self._invalidate([e.offset for e in entries])
            if err < 0:  # keep the space out of use: a restart finds the record corrupt again
                logger.error("cannot invalidate corrupt records in %s: %s", self._path, os.strerror(-err))
                return
            with self._lock:
                for e in entries:
                    self._alloc.free(e.offset - DATA_START, e.nbytes)

    # -- remove and queries ------------------------------------------------------------------------
    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Remove objects durably (their headers are zeroed); BUSY for an object being read."""
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        with self._wlock:
            gone: list[tuple[int, str, _Entry]] = []
            with self._lock:
                self._check_open()
                for i, key in enumerate(keys):
                    if check_key(key) is not None:
                        out[i] = Status.INVALID_KEY
                        continue
                    e = self._index.get(key)
                    if e is None:
                        continue
                    if e.readers:
                        out[i] = Status.BUSY
                        continue
                    del self._index[key]
                    gone.append((i, key, e))
            if not gone:
                return out
            err = self._invalidate([e.offset for _, _, e in gone])
            with self._lock:
                for i, key, e in gone:
                    if err < 0:
                        self._index[key] = e
                        out[i] = Status.IO_ERROR
                    else:
                        self._alloc.free(e.offset - DATA_START, e.nbytes)
                        out[i] = Status.OK
        return out

    def _used_bytes_now(self) -> int:
        return self._alloc.capacity - self._alloc.free_bytes

    def close(self, timeout_s: float | None = None) -> int:
        """Close the engine when owned (waiting at most ``timeout_s`` for its threads), then the
        file and the directory's lock. Idempotent; no call may be in flight. Returns how many
        engine threads were still in I/O: the file and the lock are then kept for them (closing
        the fd under a read lets it land in whatever file reuses the number)."""
        with self._wlock, self._lock:
            if self._closed:
                return 0
            self._closed = True
        stuck = int(self._engine.close(timeout_s) or 0) if self._owns_engine else 0
        if stuck:
            logger.warning("offset backend %s: %d io thread(s) still running at close; its file and "
                           "directory lock are kept for them", self.cfg.path, stuck)
            return stuck
        with self._wlock, self._lock:
            os.close(self._fd)
            self._owner.release()
        return 0
