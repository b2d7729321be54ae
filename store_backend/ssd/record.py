"""On-disk record format shared by the three SSD backends.

A record is one header block followed by the value, padded to a whole number of blocks so that
every record starts and ends on a 4 KiB boundary (O_DIRECT can read or write it in place)::

    block 0:  magic(8) flags(u32) key_len(u32) value_len(u64) seq(u64) checksum(u64) header_check(u64)
              key bytes, zero padding to 4 KiB
    block 1…: value bytes, zero padding to a multiple of 4 KiB

``checksum`` is xxh3_64 of key + value (verified on every read); ``header_check`` is xxh3_64 of the
header fields and the key, seeded per file, so a scan can tell a real header from stale bytes or
from a record-shaped value without reading the value. ``seq`` orders records of one key: the
highest valid one wins at recovery.

Also here: the I/O layout of a record (which buffers a write or a read of it uses) and the batched,
verified record read every backend's ``get_into`` goes through. Called by the backends in whichever
thread runs their put/get/recovery.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.requests import ALIGN, IoRequest, align_up, aligned_buffer
from store_backend.types import Buffer, Status

MAGIC = b"MKVREC\x00\x01"
HEADER_BLOCK = ALIGN
_HEAD = struct.Struct("<8sIIQQQ")  # magic, flags, key_len, value_len, seq, checksum
_CHECK = struct.Struct("<Q")
HEADER_FIXED = _HEAD.size + _CHECK.size  # 48 bytes before the key
MAX_KEY_IN_HEADER = HEADER_BLOCK - HEADER_FIXED


class RecordHeader(NamedTuple):
    key: bytes
    value_len: int
    seq: int
    checksum: int


def record_bytes(value_len: int) -> int:
    """Bytes a record of ``value_len`` occupies on disk (header block + padded value)."""
    return HEADER_BLOCK + align_up(value_len)


def value_checksum(key: bytes, value: Buffer) -> int:
    h = xxhash.xxh3_64(key)
    h.update(value)
    return h.intdigest()


def encode_header(block: memoryview, key: bytes, value_len: int, seq: int, checksum: int, seed: int = 0) -> None:
    """Write a header into ``block`` (at least HEADER_BLOCK bytes; the whole block is overwritten)."""
    if len(key) > MAX_KEY_IN_HEADER:
        raise ValueError(f"key of {len(key)} bytes does not fit a record header")
    head = _HEAD.pack(MAGIC, 0, len(key), value_len, seq, checksum)
    check = xxhash.xxh3_64_intdigest(head + key, seed)
    end = HEADER_FIXED + len(key)
    block[:_HEAD.size] = head
    block[_HEAD.size:HEADER_FIXED] = _CHECK.pack(check)
    block[HEADER_FIXED:end] = key
    block[end:HEADER_BLOCK] = bytes(HEADER_BLOCK - end)


def decode_header(block: Buffer, seed: int = 0) -> RecordHeader | None:
    """The header in ``block``, or None when it is not a valid header (torn, zeroed, stale)."""
    mv = memoryview(block)
    if mv.nbytes < HEADER_FIXED or mv[:8] != MAGIC:
        return None
    magic, flags, key_len, value_len, seq, checksum = _HEAD.unpack_from(mv)
    if flags != 0 or key_len > MAX_KEY_IN_HEADER or key_len > mv.nbytes - HEADER_FIXED:
        return None
    (check,) = _CHECK.unpack_from(mv, _HEAD.size)
    key = bytes(mv[HEADER_FIXED:HEADER_FIXED + key_len])
    if xxhash.xxh3_64_intdigest(bytes(mv[:_HEAD.size]) + key, seed) != check:
        return None
    return RecordHeader(key, value_len, seq, checksum)


_ZEROS = memoryview(bytes(ALIGN))


def write_buffers(header_block: memoryview, value: memoryview) -> list[Buffer]:
    """Buffers of one whole record in file order: header block, value, zero padding."""
    pad = align_up(value.nbytes) - value.nbytes
    return [header_block[:HEADER_BLOCK], value] + ([_ZEROS[:pad]] if pad else [])


def value_buffers(value: memoryview) -> list[Buffer]:
    """Buffers of a record's value blocks only (value and zero padding), for header-last writes."""
    pad = align_up(value.nbytes) - value.nbytes
    return [value] + ([_ZEROS[:pad]] if pad else [])


def status_for_errno(err: int) -> Status:
    """Per-key outcome of a failed write: out of space (disk, quota, file size limit) or I/O."""
    return Status.NO_SPACE if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else Status.IO_ERROR


class RecordRead(NamedTuple):
    """Where one record is and where its value goes."""

    fd: int
    offset: int  # file offset of the header block
    key: bytes
    value_len: int
    seq: int  # expected sequence number, or -1 to accept any
    dest: memoryview  # at least value_len bytes; the caller's


def read_records(engine: IoEngine, reads: Sequence[RecordRead], seed: int = 0) -> list[Status]:
    """Read and verify records in one batch: OK, CORRUPT (torn, wrong key, bad checksum) or IO_ERROR.

    Each read is one request (header block into scratch memory, value straight into ``dest``), and
    each record is verified as soon as it completes, while the rest are still in flight. ``dest``
    may hold garbage after a non-OK outcome.
    """
    n = len(reads)
    if not n:
        return []
    headers = aligned_buffer(n * HEADER_BLOCK)
    out = [Status.IO_ERROR] * n
    requests = [IoRequest(r.fd, r.offset, [headers[i * HEADER_BLOCK:(i + 1) * HEADER_BLOCK], r.dest[:r.value_len]])
                for i, r in enumerate(reads)]

    def verify(i: int, res: int) -> None:
        r = reads[i]
        if res < 0:
            out[i] = Status.IO_ERROR
            return
        if res < HEADER_BLOCK + r.value_len:
            out[i] = Status.CORRUPT
            return
        h = decode_header(headers[i * HEADER_BLOCK:(i + 1) * HEADER_BLOCK], seed)
        ok = (h is not None and h.key == r.key and h.value_len == r.value_len and (r.seq < 0 or h.seq == r.seq)
              and value_checksum(r.key, r.dest[:r.value_len]) == h.checksum)
        out[i] = Status.OK if ok else Status.CORRUPT

    engine.read(requests, verify)
    return out
