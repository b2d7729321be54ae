"""The bucket SSD backend (the default): the objects of one put are written once, sequentially, as
bucket files; eviction drops whole buckets.

Layout of a directory::

    bucket-<id:016x>.bkt   records (see record.py) | footer: msgpack index, padding | trailer (64 B)
    bucket-<id:016x>.tmp   a bucket being written (deleted at open: it was never acknowledged)
    tombstones.log         framed (bucket id, key) entries: keys removed from a bucket
    seq.hwm                two checksummed slots: next sequence number and bucket id (high-water mark)
    .owner.lock            the owner's pid, also flocked; the directory itself holds the lock
                           that counts (store_backend/ownership.py)

A put groups its objects into buckets (a new bucket when the next object would pass
``bucket_size_bytes`` or the bucket holds ``bucket_max_keys``), writes each bucket to a temporary
file with one gathered write, syncs them all, renames them into place and syncs the directory:
a bucket is on disk whole or not at all. The footer indexes the bucket so that opening a directory
reads only trailers and footers; a bucket whose footer is damaged is recovered by scanning and
verifying its records. Removing a key writes a tombstone; a bucket left without live keys is
deleted. When a put would pass ``capacity_bytes``, or the file system's use would pass
``disk_watermark`` of its size, whole buckets are evicted first (FIFO by creation or LRU by last
read, ``bucket_eviction``); a write that still meets ENOSPC evicts what it needs in the same order
and is tried again (twice at most).

Sequence numbers (which record of a key wins at recovery) never go back across restarts:
``seq.hwm`` holds a high-water mark, raised with an fdatasync before numbers past it are used, and
recovery also starts above the highest record on disk, tombstoned ones included.

Thread-safe: one lock guards the index; file I/O runs outside it. A bucket that is deleted while
being read stays readable through the reader's descriptor.

The file formats and the functions that read them are :mod:`store_backend.ssd.bucket_format`; opening
a directory, the high-water mark and the tombstone log are :mod:`store_backend.ssd.bucket_recovery`
(a mixin over this backend's state); this module keeps the index, writes, reads, eviction and removal.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence

import msgspec
import xxhash

from store_backend.config import ConfigError, SsdConfig
from store_backend.private import open_private
from store_backend.ssd.base import SsdStats
from store_backend.ssd.bucket_format import (
    _ENOSPC_RETRIES,
    _MAX_OPEN_FILES,
    _TRAILER,
    _TRAILER_MAGIC,
    TOMBSTONE_FILE,
    _Bucket,
    _FooterEntry,
    _Loc,
)
from store_backend.ssd.bucket_recovery import BucketRecovery
from store_backend.ssd.directory import direct_io_usable, open_directory
from store_backend.ssd.indexed import IndexedBackend
from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.requests import ALIGN, IoRequest, align_up, aligned_buffer, fsync_dir
from store_backend.ssd.record import (
    HEADER_BLOCK,
    RecordRead,
    encode_header,
    read_records,
    record_bytes,
    status_for_errno,
    value_checksum,
    write_buffers,
)
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_batch, check_key

__all__ = ["TOMBSTONE_FILE", "BucketBackend"]

logger = logging.getLogger(__name__)

class BucketBackend(BucketRecovery, IndexedBackend):
    """See the module docstring. ``engine`` does the file I/O; closed by ``close()`` when owned."""

    name = "bucket"

    def __init__(self, cfg: SsdConfig, engine: IoEngine, *, owns_engine: bool = False,
                 shared: bool = False) -> None:
        self.cfg = cfg
        self._engine = engine
        self._owns_engine = owns_engine
        self._dir = cfg.path
        if shared:
            raise ConfigError("ssd.backend='bucket' cannot share its directory (only 'file' can)")
        self._owner = open_directory(cfg)
        self._lock = threading.Lock()
        self._tomb_lock = threading.Lock()
        self._index: dict[str, _Loc] = {}
        self._buckets: dict[int, _Bucket] = {}
        self._open: dict[int, None] = {}  # ids of buckets with an open descriptor, oldest first
        self._pending: set[str] = set()
        self._reserved_bytes = 0
        self._used_bytes = 0
        self._next_id = 1
        self._seq = 1
        self._clock = 0
        self._stats = SsdStats(capacity_bytes=cfg.capacity_bytes)
        self._closed = False
        self._tomb_fd = -1
        self._hwm_fd = -1
        self._hwm_gen = 0
        self._hwm_persisted = (0, 0)  # (next seq, next bucket id) on disk; under _hwm_lock
        self._hwm_lock = threading.Lock()
        self._seq_limit = 0
        self._id_limit = 0
        try:
            self._direct = direct_io_usable(cfg, self.name)
            self._recover()
        except OSError as e:
            self._release()
            raise ConfigError(f"ssd.path={self._dir!r}: cannot open the bucket backend: {e}") from None
        except BaseException:
            self._release()
            raise


    # -- put --------------------------------------------------------------------------------------
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
                if record_bytes(v.nbytes) + 2 * ALIGN > self.cfg.capacity_bytes:
                    out[i] = Status.TOO_LARGE
                elif key in self._index or key in self._pending:
                    out[i] = Status.EXISTS
                else:
                    self._pending.add(key)
                    views[i] = v
        if not views:
            return out
        groups = self._group(list(views), views)
        try:
            full = self._write_groups(keys, views, groups, out)
            for _attempt in range(_ENOSPC_RETRIES):
                # The file system filled up under the watermark's estimate (another program, or the
                # watermark off): evict whole buckets by the eviction order and write again.
                if not full:
                    break
                need = sum(record_bytes(views[i].nbytes) for i in full) + ALIGN * len(full)
                with self._lock:
                    doomed = self._evict_bytes(need)
                if not doomed:
                    break
                logger.warning("bucket backend at %s: file system full; evicted %d buckets to write %d objects",
                               self._dir, len(doomed), len(full))
                self._delete_files(doomed)
                full = self._write_groups(keys, views, self._group(full, views), out)
        finally:
            with self._lock:
                self._pending.difference_update(keys[i] for i in views)
        return out

    def _group(self, idx: list[int], views: dict[int, memoryview]) -> list[list[int]]:
        groups: list[list[int]] = []
        size = 0
        for i in idx:
            rb = record_bytes(views[i].nbytes)
            if not groups or len(groups[-1]) >= self.cfg.bucket_max_keys or (
                    size + rb > self.cfg.bucket_size_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += rb
        return groups

    def _write_groups(self, keys: Sequence[str], views: dict[int, memoryview], groups: list[list[int]],
                      out: list[Status]) -> list[int]:
        """Write ``groups`` as new buckets, setting ``out``; the indices whose bucket write met a
        full file system (ENOSPC, EDQUOT)."""
        # Lay each bucket out: records, then footer and trailer, then reserve its bytes.
        plans: list[tuple[int, list[int], list[Buffer], list[_FooterEntry], int]] = []
        nrec = sum(len(g) for g in groups)
        try:
            seq, bid = self._take_numbers(nrec, len(groups))
        except OSError as e:
            logger.error("bucket backend at %s: cannot persist the sequence high-water mark: %s", self._dir, e)
            idx = [i for g in groups for i in g]
            for i in idx:
                out[i] = status_for_errno(e.errno or errno.EIO)
            return idx if e.errno in (errno.ENOSPC, errno.EDQUOT) else []
        bid -= 1
        headers = aligned_buffer(nrec * HEADER_BLOCK)
        hpos = 0
        with self._lock:
            for g in groups:
                bid += 1
                bufs: list[Buffer] = []
                entries: list[_FooterEntry] = []
                pos = 0
                for i in g:
                    key_b = keys[i].encode()
                    v = views[i]
                    checksum = value_checksum(key_b, v)
                    block = headers[hpos:hpos + HEADER_BLOCK]
                    hpos += HEADER_BLOCK
                    encode_header(block, key_b, v.nbytes, seq, checksum)
                    bufs += write_buffers(block, v)
                    entries.append(_FooterEntry(keys[i], pos, v.nbytes, seq, checksum))
                    seq += 1
                    pos += record_bytes(v.nbytes)
                footer = msgspec.msgpack.encode(entries)
                tail_len = align_up(len(footer) + _TRAILER.size)
                tail = bytearray(tail_len)
                tail[:len(footer)] = footer
                tail[-_TRAILER.size:] = _TRAILER.pack(_TRAILER_MAGIC, bid, pos, len(footer),
                                                      xxhash.xxh3_64_intdigest(footer), len(entries))
                bufs.append(tail)
                plans.append((bid, g, bufs, entries, pos + tail_len))
            doomed, admitted = self._make_room([p[4] for p in plans])
        self._delete_files(doomed)

        writable = []
        for k, (bid, g, bufs, entries, nbytes) in enumerate(plans):
            if k < admitted:
                writable.append(k)
            else:
                for i in g:
                    out[i] = Status.NO_SPACE
        fds: dict[int, int] = {}
        results: dict[int, int] = {}
        try:
            for k in writable:
                try:
                    fds[k] = open_private(self._bucket_path(plans[k][0], tmp=True),
                                          os.O_CREAT | os.O_EXCL | os.O_WRONLY | (os.O_DIRECT if self._direct else 0))
                except OSError as e:
                    results[k] = -(e.errno or errno.EIO)
            order = [k for k in writable if k in fds]
            for k, res in zip(order, self._engine.write([IoRequest(fds[k], 0, plans[k][2]) for k in order])):
                results[k] = res if res < 0 else 0
            synced = [k for k in order if results[k] == 0]
            for k, res in zip(synced, self._engine.sync([fds[k] for k in synced])):
                results[k] = res
        finally:
            for fd in fds.values():
                os.close(fd)
        done: list[int] = []
        for k in writable:
            tmp = self._bucket_path(plans[k][0], tmp=True)
            if results.get(k, -errno.EIO) == 0:
                try:
                    os.rename(tmp, self._bucket_path(plans[k][0]))
                    done.append(k)
                    continue
                except OSError as e:
                    results[k] = -(e.errno or errno.EIO)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if done:
            try:
                fsync_dir(self._dir)
            except OSError as e:
                logger.error("fsync of %s failed: %s", self._dir, e)
                for k in done:
                    results[k] = -(e.errno or errno.EIO)
                done = []
        full: list[int] = []
        with self._lock:
            for k in writable:
                bid, g, _, entries, nbytes = plans[k]
                self._reserved_bytes -= nbytes
                if k in done:
                    self._clock += 1
                    self._buckets[bid] = _Bucket(bid, self._bucket_path(bid), nbytes,
                                                 {keys[i] for i in g}, self._clock)
                    self._used_bytes += nbytes
                    for i, e in zip(g, entries):
                        self._index[keys[i]] = _Loc(bid, e.offset, e.value_len, e.seq)
                        out[i] = Status.OK  # a retry after a full file system may follow a NO_SPACE
                else:
                    err = -results.get(k, -errno.EIO)
                    if err not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        logger.error("writing bucket %d failed: %s", bid, os.strerror(err))
                    for i in g:
                        out[i] = status_for_errno(err)
                    if err in (errno.ENOSPC, errno.EDQUOT):
                        full += g
        return full

    def _make_room(self, sizes: list[int]) -> tuple[list[_Bucket], int]:
        """Under the lock: evict buckets so that the new ones fit; returns the evicted buckets and
        how many of the new ones (in order) may be written, their bytes reserved.

        Nothing is evicted for a bucket that eviction cannot make room for (the disk is full of
        other files, say): that bucket and the rest answer NO_SPACE and the stored ones stay.
        ``disk_watermark`` 1.0 turns the file-system check off (the disk's own ENOSPC answers).
        """
        cap = self.cfg.capacity_bytes
        watch_fs = self.cfg.disk_watermark < 1.0
        fs_used = fs_limit = 0.0
        if watch_fs:
            try:
                st = os.statvfs(self._dir)
                fs_used = (st.f_blocks - st.f_bavail) * st.f_frsize
                fs_limit = self.cfg.disk_watermark * st.f_blocks * st.f_frsize
                watch_fs = st.f_blocks > 0  # ramfs and friends report no size at all
            except OSError:
                watch_fs = False
        if self.cfg.bucket_eviction == "fifo":
            order = sorted(self._buckets.values(), key=lambda b: b.id)
        else:
            order = sorted(self._buckets.values(), key=lambda b: b.last_access)
        evictable = sum(b.file_bytes for b in order)
        victims: list[_Bucket] = []
        admitted = 0
        for size in sizes:
            need = self._used_bytes + self._reserved_bytes + size - cap
            if watch_fs:
                need = max(need, fs_used + size - fs_limit)
            if need > evictable:
                break
            while need > 0:
                b = order.pop(0)
                victims.append(b)
                self._stats.evictions += len(b.live)
                self._note_evicted(self._bucket_keys(b))
                self._drop_bucket(b)
                fs_used -= b.file_bytes
                evictable -= b.file_bytes
                need -= b.file_bytes
            self._reserved_bytes += size
            fs_used += size
            admitted += 1
        return victims, admitted

    def _evict_bytes(self, nbytes: int) -> list[_Bucket]:
        """Under the lock: evict whole buckets in eviction order until ``nbytes`` are freed."""
        order = sorted(self._buckets.values(),
                       key=(lambda b: b.id) if self.cfg.bucket_eviction == "fifo" else (lambda b: b.last_access))
        victims: list[_Bucket] = []
        for b in order:
            if nbytes <= 0:
                break
            victims.append(b)
            self._stats.evictions += len(b.live)
            nbytes -= b.file_bytes
            self._note_evicted(self._bucket_keys(b))
            self._drop_bucket(b)
        return victims

    def _bucket_keys(self, b: _Bucket) -> list[str]:
        """Under the lock: the keys whose live record is in ``b``."""
        return [k for k in b.live if (loc := self._index.get(k)) is not None and loc.bucket == b.id]

    def _drop_bucket(self, b: _Bucket) -> None:
        """Under the lock: forget a bucket and its keys (the file is deleted by the caller)."""
        for key in b.live:
            loc = self._index.get(key)
            if loc is not None and loc.bucket == b.id:
                del self._index[key]
        b.live = set()
        b.deleted = True
        del self._buckets[b.id]
        self._used_bytes -= b.file_bytes
        if b.fd >= 0 and b.readers == 0:
            os.close(b.fd)
            b.fd = -1
            self._open.pop(b.id, None)

    def _delete_files(self, buckets: list[_Bucket]) -> None:
        """Unlink buckets and make it durable (an evicted bucket must not come back after a crash)."""
        for b in buckets:
            try:
                os.unlink(b.path)
            except FileNotFoundError:
                pass
        if buckets:
            try:
                fsync_dir(self._dir)
            except OSError as e:
                logger.error("fsync of %s failed: %s", self._dir, e)

    # -- get ---------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy objects into the caller's buffers, verifying each; CORRUPT ones are dropped."""
        check_batch(keys, buffers)
        out = [ReadResult(Status.NOT_FOUND)] * len(keys)
        reads: list[tuple[int, _Bucket, RecordRead]] = []
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = ReadResult(Status.INVALID_KEY)
                    continue
                loc = self._index.get(key)
                if loc is None:
                    continue
                dest = byte_view(buffers[i])
                if dest.nbytes < loc.value_len:
                    out[i] = ReadResult(Status.BUFFER_TOO_SMALL)
                    continue
                b = self._buckets[loc.bucket]
                try:
                    fd = self._fd(b)
                except OSError as e:
                    logger.error("cannot open %s: %s", b.path, e)
                    out[i] = ReadResult(Status.IO_ERROR)
                    continue
                b.readers += 1
                self._clock += 1
                b.last_access = self._clock
                reads.append((i, b, RecordRead(fd, loc.offset, key.encode(), loc.value_len, loc.seq, dest)))
        if not reads:
            return out
        try:
            statuses = read_records(self._engine, [r for _, _, r in reads])
        finally:
            with self._lock:
                for _, b, _ in reads:
                    b.readers -= 1
                    if b.deleted and b.readers == 0 and b.fd >= 0:
                        os.close(b.fd)
                        b.fd = -1
                        self._open.pop(b.id, None)
        corrupt: list[tuple[int, str]] = []
        for (i, b, r), st in zip(reads, statuses):
            out[i] = ReadResult(st, r.value_len if st is Status.OK else 0)
            if st is Status.CORRUPT:
                corrupt.append((b.id, keys[i]))
        if corrupt:
            logger.warning("%d corrupt records in %s dropped", len(corrupt), self._dir)
            try:
                self._forget(corrupt, corrupt=True)
            except OSError as e:  # the tombstone is lost: the record is found corrupt again later
                logger.error("cannot tombstone corrupt records in %s: %s", self._dir, e)
        return out

    def _fd(self, b: _Bucket) -> int:
        """Under the lock: the bucket's read descriptor, opened on demand (a few hundred stay open)."""
        if b.fd >= 0:
            self._open.pop(b.id, None)
            self._open[b.id] = None
            return b.fd
        b.fd = os.open(b.path, os.O_RDONLY | (os.O_DIRECT if self._direct else 0))
        self._open[b.id] = None
        if len(self._open) > _MAX_OPEN_FILES:
            for bid in list(self._open):
                if len(self._open) <= _MAX_OPEN_FILES:
                    break
                other = self._buckets.get(bid)
                if other is not None and other.readers == 0 and other is not b:
                    os.close(other.fd)
                    other.fd = -1
                    del self._open[bid]
        return b.fd

    # -- remove and queries ------------------------------------------------------------------------
    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Remove objects durably (a tombstone each); the bucket file goes when its last key does."""
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        targets: list[tuple[int, str]] = []
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = Status.INVALID_KEY
                    continue
                loc = self._index.get(key)
                if loc is not None:
                    targets.append((loc.bucket, key))
                    out[i] = Status.OK
        if targets:
            try:
                self._forget(targets)
            except OSError as e:
                logger.error("remove in %s failed: %s", self._dir, e)
                return [Status.IO_ERROR if st is Status.OK else st for st in out]
        return out

    def _forget(self, targets: list[tuple[int, str]], corrupt: bool = False) -> None:
        """Tombstone (bucket, key) pairs durably, drop them from the index, delete emptied buckets."""
        self._append_tombstones(targets)
        emptied: list[_Bucket] = []
        with self._lock:
            for bid, key in targets:
                loc = self._index.get(key)
                if loc is None or loc.bucket != bid:
                    continue
                del self._index[key]
                if corrupt:
                    self._stats.corrupt_reads += 1
                b = self._buckets.get(bid)
                if b is not None:
                    b.live.discard(key)
                    if not b.live:
                        self._drop_bucket(b)
                        emptied.append(b)
        self._delete_files(emptied)

    def _release(self) -> None:
        """Close every descriptor, then give up the directory's lock (last: nothing is written after)."""
        for b in self._buckets.values():
            if b.fd >= 0:
                os.close(b.fd)
                b.fd = -1
        self._open.clear()
        for name in ("_tomb_fd", "_hwm_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        self._owner.release()

    def close(self, timeout_s: float | None = None) -> int:
        """Close the engine when owned (waiting at most ``timeout_s`` for its threads), then the
        descriptors and the directory's lock. Idempotent; no call may be in flight. Returns how
        many engine threads were still in I/O: the descriptors and the lock are then kept for
        them (closing an fd under a read lets it land in whatever file reuses the number)."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        stuck = int(self._engine.close(timeout_s) or 0) if self._owns_engine else 0
        if stuck:
            logger.warning("bucket backend %s: %d io thread(s) still running at close; its descriptors "
                           "and directory lock are kept for them", self.cfg.path, stuck)
            return stuck
        with self._lock:
            self._release()
        return 0
