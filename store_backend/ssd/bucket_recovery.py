"""The bucket backend's recovery and bookkeeping files: opening a directory (trailers and footers,
a damaged footer's records scanned and verified, tombstones applied, the newest record of each key
kept), the sequence high-water mark (raised with an fdatasync before numbers past it are used) and
the tombstone log.

A mixin of :class:`~store_backend.ssd.bucket.BucketBackend` over its one state (set in
``BucketBackend.__init__``): see that module's docstring for the layout and the rules."""

from __future__ import annotations

import logging
import os
import struct

import msgspec
import xxhash

from store_backend.private import open_private
from store_backend.ssd.bucket_format import (
    _HWM,
    _HWM_FILE,
    _HWM_MAGIC,
    _HWM_STEP,
    TOMBSTONE_FILE,
    _Bucket,
    _FooterEntry,
    _frame,
    _Loc,
    bucket_file_id,
    live_records,
    read_footer,
    read_tombstones,
    scan_records,
)
from store_backend.ssd.io.requests import ALIGN, fsync_dir

logger = logging.getLogger(__name__)


class BucketRecovery:
    """Recovery and bookkeeping of :class:`~store_backend.ssd.bucket.BucketBackend` (see the module docstring)."""

    def _recover(self) -> None:
        found: dict[int, list[_FooterEntry]] = {}
        sizes: dict[int, int] = {}
        seen_ids: list[int] = []
        skipped: set[int] = set()
        for name in sorted(os.listdir(self._dir)):
            named = bucket_file_id(name)
            if named is None:
                continue
            path = os.path.join(self._dir, name)
            bid, tmp = named
            if tmp:
                os.unlink(path)  # never renamed into place, so never acknowledged
                continue
            seen_ids.append(bid)
            try:
                entries = self._load_bucket(bid, path)
                if entries is None:
                    continue
                sizes[bid] = os.stat(path).st_size
            except OSError as e:
                # One bad file must not keep the store closed: it stays on disk (for inspection, and
                # its id is never reused) and its objects are misses.
                self._stats.unreadable_files += 1
                skipped.add(bid)
                logger.error("bucket backend at %s: skipping unreadable %s: %s", self._dir, name, e)
                continue
            found[bid] = entries
        tombs = self._load_tombstones()
        hwm_seq, hwm_id = self._load_hwm()
        winners = live_records(found, tombs)
        self._seq = max([self._seq] + [e.seq + 1 for entries in found.values() for e in entries])
        # Sequence numbers never go back (a key removed, then put again with other bytes, must win
        # over the old record even if the tombstone that hid it is lost): the persisted high-water
        # mark covers every number handed out before the restart.
        self._seq = max(self._seq, hwm_seq)
        self._seq_limit = self._seq
        live: dict[int, set[str]] = {bid: set() for bid in found}
        for key, (bid, e) in winners.items():
            live[bid].add(key)
            self._index[key] = _Loc(bid, e.offset, e.value_len, e.seq)
        for bid in sorted(found):
            path = self._bucket_path(bid)
            if not live[bid]:
                os.unlink(path)
                continue
            self._clock += 1
            self._buckets[bid] = _Bucket(bid, path, sizes[bid], live[bid], self._clock)
            self._used_bytes += sizes[bid]
        ids = seen_ids + [bid for bid, _ in tombs]
        self._next_id = max(max(ids, default=0) + 1, hwm_id)
        self._id_limit = self._next_id
        self._rewrite_tombstones({t for t in tombs if t[0] in self._buckets or t[0] in skipped})
        fsync_dir(self._dir)
        self._stats.recovered_objects = len(self._index)
        if self._index or self._stats.discarded_records:
            logger.info("bucket backend at %s: recovered %d objects in %d buckets (%d records discarded)",
                        self._dir, len(self._index), len(self._buckets), self._stats.discarded_records)

    def _bucket_path(self, bid: int, tmp: bool = False) -> str:
        return os.path.join(self._dir, f"bucket-{bid:016x}.{'tmp' if tmp else 'bkt'}")

    def _load_bucket(self, bid: int, path: str) -> list[_FooterEntry] | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            entries = self._read_footer(fd, bid, size)
            if entries is None:
                logger.warning("bucket %s: footer damaged, scanning its records", path)
                entries = self._scan_records(fd, size)
        finally:
            os.close(fd)
        if not entries:
            os.unlink(path)
            return None
        return entries

    @staticmethod
    def _read_footer(fd: int, bid: int, size: int) -> list[_FooterEntry] | None:
        return read_footer(fd, bid, size)

    def _scan_records(self, fd: int, size: int) -> list[_FooterEntry]:
        """Fallback: walk the records from the start, keeping each one whose checksum verifies."""
        entries, dropped = scan_records(fd, size)
        self._stats.discarded_records += len(dropped)
        return entries

    def _load_tombstones(self) -> set[tuple[int, str]]:
        return read_tombstones(self._dir)

    def _load_hwm(self) -> tuple[int, int]:
        """The persisted (next sequence number, next bucket id); (0, 0) when there is none yet.

        ``seq.hwm`` holds two checksummed slots written in turn, so a write torn by a power loss
        leaves the other slot (which still covers every number handed out before it)."""
        path = os.path.join(self._dir, _HWM_FILE)
        self._hwm_fd = open_private(path, os.O_RDWR | os.O_CREAT)
        raw = os.pread(self._hwm_fd, 2 * ALIGN, 0)
        best = (0, 0, 0)
        damaged = False
        for slot in range(2):
            rec = raw[slot * ALIGN:slot * ALIGN + _HWM.size]
            if len(rec) < _HWM.size:
                damaged = damaged or any(rec)
                continue
            magic, gen, seq, bid, check = _HWM.unpack(rec)
            if magic == _HWM_MAGIC and xxhash.xxh3_64_intdigest(rec[:-8]) == check:
                if gen >= best[0]:
                    best = (gen, seq, bid)
            elif any(rec):
                damaged = True  # all zeroes is a slot never written (the file is zero-filled at once)
        size = os.fstat(self._hwm_fd).st_size
        if best[0] == 0 and damaged:
            logger.warning("bucket backend at %s: %s is damaged; sequence numbers continue from the records",
                           self._dir, _HWM_FILE)
        if size < 2 * ALIGN:
            # Both slots written once now, so raising the mark later never needs a new block (and
            # cannot fail on a full disk).
            try:
                os.pwrite(self._hwm_fd, bytes(2 * ALIGN - size), size)
                os.fdatasync(self._hwm_fd)
            except OSError as e:
                logger.warning("bucket backend at %s: cannot size %s: %s", self._dir, _HWM_FILE, e)
        self._hwm_gen = best[0]
        self._hwm_persisted = (best[1], best[2])
        return best[1], best[2]

    def _persist_hwm(self, seq: int, bid: int) -> None:
        """Make (seq, bid) durable as the new high-water mark (``_hwm_lock`` held, not ``_lock``).

        Never lowers it: two callers compute their marks under ``_lock`` and persist them here in
        either order, so the mark written is the larger of each number and the one already on
        disk (nothing is written when that already covers both)."""
        seq = max(seq, self._hwm_persisted[0])
        bid = max(bid, self._hwm_persisted[1])
        if self._hwm_gen and (seq, bid) == self._hwm_persisted:
            with self._lock:
                self._seq_limit = max(self._seq_limit, seq)
                self._id_limit = max(self._id_limit, bid)
            return
        gen = self._hwm_gen + 1
        rec = _HWM.pack(_HWM_MAGIC, gen, seq, bid, 0)[:-8]
        rec += struct.pack("<Q", xxhash.xxh3_64_intdigest(rec))
        os.pwrite(self._hwm_fd, rec, (gen % 2) * ALIGN)
        os.fdatasync(self._hwm_fd)
        self._hwm_gen = gen
        self._hwm_persisted = (seq, bid)
        with self._lock:
            self._seq_limit = max(self._seq_limit, seq)
            self._id_limit = max(self._id_limit, bid)

    def _take_numbers(self, nseq: int, nids: int) -> tuple[int, int]:
        """First of ``nseq`` new sequence numbers and ``nids`` new bucket ids, all below the
        persisted high-water mark (raised, with one fdatasync, every ``_HWM_STEP`` numbers)."""
        while True:
            with self._lock:
                if self._seq + nseq <= self._seq_limit and self._next_id + nids <= self._id_limit:
                    seq, bid = self._seq, self._next_id
                    self._seq += nseq
                    self._next_id += nids
                    return seq, bid
                want = (self._seq + nseq + _HWM_STEP, self._next_id + nids + _HWM_STEP)
            with self._hwm_lock:
                self._persist_hwm(*want)

    def _rewrite_tombstones(self, tombs: set[tuple[int, str]]) -> None:
        path = os.path.join(self._dir, TOMBSTONE_FILE)
        tmp = path + ".tmp"
        data = b"".join(_frame(msgspec.msgpack.encode(t)) for t in sorted(tombs))
        fd = open_private(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY)
        try:
            os.write(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._tomb_fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def _append_tombstones(self, tombs: list[tuple[int, str]]) -> None:
        if not tombs:
            return
        data = b"".join(_frame(msgspec.msgpack.encode(t)) for t in tombs)
        with self._tomb_lock:
            os.write(self._tomb_fd, data)
            os.fdatasync(self._tomb_fd)
