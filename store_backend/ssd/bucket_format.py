"""The bucket backend's on-disk format: bucket files (records, footer, trailer), the tombstone log
and the sequence high-water mark, and the pure functions that read them (used by the backend's
recovery and by :mod:`store_backend.ssd.inspect`). No state; reads only the descriptors it is given."""

from __future__ import annotations

import logging
import os
import re
import struct

import msgspec
import xxhash

from store_backend.ssd.record import HEADER_BLOCK, decode_header, record_bytes, value_checksum

logger = logging.getLogger(__name__)

_TRAILER = struct.Struct("<8sQQQQI")  # magic, bucket id, footer offset, footer length, footer xxh3, count
_TRAILER_MAGIC = b"MKVBKT\x00\x01"
_FRAME = struct.Struct("<IQ")  # tombstone frame: payload length, xxh3_64 of payload
_NAME = re.compile(r"^bucket-([0-9a-f]{16})\.(bkt|tmp)$")
_MAX_OPEN_FILES = 256  # bucket descriptors kept open for readers
_ENOSPC_RETRIES = 2  # write passes after the first one that met a full file system
_HWM_FILE = "seq.hwm"
TOMBSTONE_FILE = "tombstones.log"
_HWM = struct.Struct("<8sQQQQ")  # magic, generation, next seq, next bucket id, xxh3_64 of the rest
_HWM_MAGIC = b"MKVHWM\x00\x01"
_HWM_STEP = 1 << 16  # numbers handed out per high-water-mark write


class _FooterEntry(msgspec.Struct, array_like=True):
    key: str
    offset: int
    value_len: int
    seq: int
    checksum: int


class _Loc(msgspec.Struct):
    bucket: int
    offset: int
    value_len: int
    seq: int


class _Bucket:
    __slots__ = ("id", "path", "file_bytes", "live", "last_access", "fd", "readers", "deleted")

    def __init__(self, bucket_id: int, path: str, file_bytes: int, live: set[str], last_access: int) -> None:
        self.id = bucket_id
        self.path = path
        self.file_bytes = file_bytes
        self.live = live
        self.last_access = last_access
        self.fd = -1
        self.readers = 0
        self.deleted = False


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


# -- read-only directory reading (recovery uses these; so does store_backend.ssd.inspect) ----------

def bucket_file_id(name: str) -> tuple[int, bool] | None:
    """(bucket id, is a temporary file) for a bucket file's name; None for any other name."""
    m = _NAME.match(name)
    return None if m is None else (int(m.group(1), 16), m.group(2) == "tmp")


def read_footer(fd: int, bid: int, size: int) -> list[_FooterEntry] | None:
    """The index in the footer of bucket ``bid`` (open at ``fd``, ``size`` bytes long), or None
    when its trailer or footer is damaged. Reads only."""
    if size < _TRAILER.size:
        return None
    magic, tid, foff, flen, fcheck, count = _TRAILER.unpack(os.pread(fd, _TRAILER.size, size - _TRAILER.size))
    if magic != _TRAILER_MAGIC or tid != bid or foff + flen > size - _TRAILER.size:
        return None
    footer = os.pread(fd, flen, foff)
    if len(footer) != flen or xxhash.xxh3_64_intdigest(footer) != fcheck:
        return None
    try:
        entries = msgspec.msgpack.decode(footer, type=list[_FooterEntry])
    except msgspec.DecodeError:
        return None
    if len(entries) != count or any(e.offset + record_bytes(e.value_len) > foff for e in entries):
        return None
    return entries


def scan_records(fd: int, size: int) -> tuple[list[_FooterEntry], list[tuple[int, bytes]]]:
    """Walk a bucket's records from the start (its footer being damaged): the entries whose
    checksum verifies, and (offset, key) of each record dropped (cut short, bad checksum, a key
    that is not UTF-8). Reads only."""
    out: list[_FooterEntry] = []
    dropped: list[tuple[int, bytes]] = []
    pos = 0
    while pos + HEADER_BLOCK <= size:
        h = decode_header(os.pread(fd, HEADER_BLOCK, pos))
        if h is None:
            break
        if pos + record_bytes(h.value_len) > size:  # cut short
            dropped.append((pos, h.key))
            break
        value = os.pread(fd, h.value_len, pos + HEADER_BLOCK)
        if len(value) == h.value_len and value_checksum(h.key, value) == h.checksum:
            try:
                out.append(_FooterEntry(h.key.decode(), pos, h.value_len, h.seq, h.checksum))
            except UnicodeDecodeError:
                dropped.append((pos, h.key))
        else:
            dropped.append((pos, h.key))
        pos += record_bytes(h.value_len)
    return out, dropped


def read_tombstones(directory: str) -> set[tuple[int, str]]:
    """The (bucket id, key) pairs in ``directory``'s tombstone log, up to a torn or damaged tail
    (logged). Reads only."""
    path = os.path.join(directory, TOMBSTONE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    out: set[tuple[int, str]] = set()
    pos = 0
    while pos + _FRAME.size <= len(data):
        n, check = _FRAME.unpack_from(data, pos)
        payload = data[pos + _FRAME.size:pos + _FRAME.size + n]
        if len(payload) != n or xxhash.xxh3_64_intdigest(payload) != check:
            break  # a torn tail: the remove it belonged to never returned
        try:
            bid, key = msgspec.msgpack.decode(payload, type=tuple[int, str])
        except msgspec.DecodeError:
            logger.error("bucket backend at %s: tombstone log damaged at byte %d; later entries ignored",
                         directory, pos)
            break
        out.add((bid, key))
        pos += _FRAME.size + n
    return out


def live_records(found: dict[int, list[_FooterEntry]],
                 tombs: set[tuple[int, str]]) -> dict[str, tuple[int, _FooterEntry]]:
    """key -> (bucket id, entry) of the record recovery serves: the highest (seq, bucket id) of
    the key's records not tombstoned in their bucket."""
    winners: dict[str, tuple[int, _FooterEntry]] = {}
    for bid in sorted(found):
        for e in found[bid]:
            if (bid, e.key) in tombs:
                continue
            best = winners.get(e.key)
            if best is None or (e.seq, bid) > (best[1].seq, best[0]):
                winners[e.key] = (bid, e)
    return winners
