"""The offset backend's on-disk format and its pieces without I/O state: the data file's superblock,
the scan that finds records after a crash and picks each key's winner (used by the backend's
recovery and by :mod:`store_backend.ssd.inspect`), and the free-extent allocator of the file."""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from store_backend.ssd.io.requests import ALIGN, align_down
from store_backend.ssd.record import HEADER_BLOCK, MAGIC, decode_header, record_bytes

logger = logging.getLogger(__name__)

FILE_NAME = "offset.data"
DATA_START = ALIGN
_SUPER = struct.Struct("<8sQQQ")  # magic, seed, file bytes, xxh3_64 of the first three
_SUPER_MAGIC = b"MKVOFF\x00\x01"
_SCAN_CHUNK = 1 << 20
_ENOSPC_RETRIES = 2  # write passes after the first one that met a full file system
_ENOSPC_MAX_VICTIMS = 64  # records looked at per object when making room on a full file system
_ZERO_BLOCK = memoryview(bytes(HEADER_BLOCK))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _fallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2) without glibc's write-zeros emulation (which would write the whole file)."""
    if _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# -- read-only file reading (recovery uses these; so does store_backend.ssd.inspect) ---------------

_Found = tuple[int, int, int, bytes]  # a record found by the walk: offset, value_len, seq, key


def decode_superblock(raw: bytes) -> tuple[int, int] | None:
    """(header seed, file bytes at creation) from a data file's first bytes; None when they are
    not an offset-backend superblock."""
    if len(raw) < _SUPER.size:
        return None
    magic, seed, size, check = _SUPER.unpack(raw[:_SUPER.size])
    if magic != _SUPER_MAGIC or xxhash.xxh3_64_intdigest(raw[:24]) != check:
        return None
    return seed, size


def scan_records(path: str, seed: int, size: int) -> tuple[list[_Found], list[int]]:
    """Walk the first ``size`` bytes of the data file at ``path``: (offset, value_len, seq, key) of
    every record whose header is valid, and the offsets of blocks that could not be read (skipped,
    logged). Reads only (it drops the file's cached pages, which changes no byte)."""
    found: list[tuple[int, int, int, bytes]] = []
    unreadable: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    # No readahead and no cached pages: cached zero pages of preallocated (unwritten) space
    # would count as data for SEEK_DATA, and the walk would read the whole file.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        pos = DATA_START
        while pos + HEADER_BLOCK <= size:
            try:
                pos = max(pos, align_down(os.lseek(fd, pos, os.SEEK_DATA)))
            except OSError as e:
                if e.errno == errno.ENXIO:  # only holes from here on
                    break
                raise
            try:
                h = decode_header(os.pread(fd, HEADER_BLOCK, pos), seed)
            except OSError as e:  # an unreadable block: skip it, serve the rest
                unreadable.append(pos)
                logger.error("offset backend: cannot read %s at %d (%s); skipping that block", path, pos, e)
                pos += HEADER_BLOCK
                continue
            if h is not None and pos + record_bytes(h.value_len) <= size:
                found.append((pos, h.value_len, h.seq, h.key))
                pos += record_bytes(h.value_len)
                continue
            pos = _next_candidate(fd, pos + HEADER_BLOCK, seed, size)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return found, unreadable


def _next_candidate(fd: int, pos: int, seed: int, size: int) -> int:
    """First block at or after ``pos`` that starts with a valid record header (or ``size``);
    holes are skipped without reading them."""
    magic = np.frombuffer(MAGIC, dtype="<u8")[0]
    while pos < size:
        try:
            pos = max(pos, align_down(os.lseek(fd, pos, os.SEEK_DATA)))
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break
            raise
        n = min(_SCAN_CHUNK, max(ALIGN, align_down(hole - pos)), size - pos)
        chunk = os.pread(fd, n, pos)
        if len(chunk) < ALIGN:
            break
        firsts = np.frombuffer(chunk, dtype="<u8", count=len(chunk) // 8)[::ALIGN // 8]
        hits = np.flatnonzero(firsts == magic)
        for h in hits:
            off = pos + int(h) * ALIGN
            if decode_header(chunk[int(h) * ALIGN:(int(h) + 1) * ALIGN], seed) is not None:
                return off
        pos += align_down(len(chunk))
    return size


def pick_winners(found: list[_Found]) -> tuple[dict[bytes, _Found], list[int]]:
    """The record recovery serves for each key (the highest sequence number) and the offsets of
    the superseded ones (``found`` as :func:`scan_records` returns it)."""
    best: dict[bytes, _Found] = {}
    losers: list[int] = []
    for rec in found:
        other = best.get(rec[3])
        if other is None or rec[2] > other[2]:
            if other is not None:
                losers.append(other[0])
            best[rec[3]] = rec
        else:
            losers.append(rec[0])
    return best, losers


class FreeExtents:
    """First-fit allocator over [0, capacity) with coalescing, able to reserve a given extent
    (recovery rebuilds it from the records found). Not thread-safe: the backend's lock guards it."""

    def __init__(self, capacity: int, used: Sequence[tuple[int, int]] = ()) -> None:
        self.capacity = capacity
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self.free_bytes = 0
        pos = 0
        for off, size in sorted(used):
            if off > pos:
                self._starts.append(pos)
                self._sizes.append(off - pos)
            pos = max(pos, off + size)
        if capacity > pos:
            self._starts.append(pos)
            self._sizes.append(capacity - pos)
        self.free_bytes = sum(self._sizes)

    def allocate(self, size: int) -> int | None:
        for k, n in enumerate(self._sizes):
            if n >= size:
                off = self._starts[k]
                if n == size:
                    del self._starts[k], self._sizes[k]
                else:
                    self._starts[k] += size
                    self._sizes[k] -= size
                self.free_bytes -= size
                return off
        return None

    def free(self, off: int, size: int) -> None:
        k = bisect.bisect_left(self._starts, off)
        self._starts.insert(k, off)
        self._sizes.insert(k, size)
        self.free_bytes += size
        if k + 1 < len(self._starts) and off + size == self._starts[k + 1]:
            self._sizes[k] += self._sizes[k + 1]
            del self._starts[k + 1], self._sizes[k + 1]
        if k > 0 and self._starts[k - 1] + self._sizes[k - 1] == off:
            self._sizes[k - 1] += self._sizes[k]
            del self._starts[k], self._sizes[k]

    def reserve(self, off: int, size: int) -> bool:
        """Take exactly [off, off + size) out of free space; False when it is not wholly free."""
        k = bisect.bisect_right(self._starts, off) - 1
        if k < 0 or self._starts[k] + self._sizes[k] < off + size:
            return False
        start, n = self._starts[k], self._sizes[k]
        del self._starts[k], self._sizes[k]
        if off + size < start + n:
            self._starts.insert(k, off + size)
            self._sizes.insert(k, start + n - off - size)
        if off > start:
            self._starts.insert(k, start)
            self._sizes.insert(k, off - start)
        self.free_bytes -= size
        return True


class _Entry:
    __slots__ = ("offset", "value_len", "seq", "readers", "dead", "zapped")

    def __init__(self, offset: int, value_len: int, seq: int) -> None:
        self.offset = offset  # file offset of the header block
        self.value_len = value_len
        self.seq = seq
        self.readers = 0
        self.dead = False  # found corrupt: invalidate once the last reader is done
        self.zapped = False

    @property
    def nbytes(self) -> int:
        return record_bytes(self.value_len)
