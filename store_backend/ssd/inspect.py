"""Inspecting an SSD tier directory without changing it: which backend wrote it, what it holds,
what an open would clean up, and (``verify``) which records fail their checksum.

:func:`inspect_directory` returns an :class:`InspectReport` (plain data; ``mooncake-kv inspect``
in :mod:`mooncake_kv.inspect_cli` prints it). The backend is detected from the files on
disk; each backend is read through its own read-only recovery helpers (``read_footer``,
``scan_records``, ``read_tombstones``, ``live_records`` in :mod:`~store_backend.ssd.bucket_format`;
``decode_superblock``, ``scan_records``, ``pick_winners`` in :mod:`~store_backend.ssd.offset_format`;
``read_record_header`` in :mod:`~store_backend.ssd.file_per_key`), so the objects counted are
the ones a store opened on the directory would serve; verification reads every such record
through :func:`store_backend.ssd.record.read_records`, the check every ``get_into`` makes.

Nothing in the directory is written, created, renamed, truncated or deleted: temporary files and
emptied buckets that an open would delete are only listed, damaged records are only named, and
the owner locks (on the directory itself and on its ``.owner.lock`` note, see
:mod:`store_backend.ownership`) are taken on descriptors opened read-only, the note's only when
it exists. While inspecting, both are held exclusively, so a store cannot open the directory (it
is refused naming this process) and the files stay still. When a store or a
``shared_ssd`` process holds the lock, inspection is refused with :class:`DirectoryInUse`
unless ``force``: then the files are read as they are, and the report says it may be
inconsistent.

Blocking; called from one thread (the CLI's). Reading is buffered (no O_DIRECT: probing for it
would create a file).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable

import msgspec

from store_backend.ownership import LOCK_FILE, flock_holders
from store_backend.ssd import bucket_format as bucket
from store_backend.ssd import file_per_key
from store_backend.ssd import offset_format as offset
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.requests import ALIGN, align_down, aligned_buffer
from store_backend.ssd.record import RecordRead, read_records, record_bytes
from store_backend.types import Status

logger = logging.getLogger(__name__)

BACKENDS = ("bucket", "offset", "file")
_VERIFY_BATCH_BYTES = 64 << 20  # value bytes read per verification batch
_VERIFY_BATCH_RECORDS = 256
_HEX = frozenset("0123456789abcdef")

Progress = Callable[[int, int], None]  # (value bytes verified so far, value bytes to verify)


class InspectError(Exception):
    """The directory cannot be inspected (missing, not a directory, unreadable, ambiguous)."""


class DirectoryInUse(InspectError):
    """A store (or ``shared_ssd`` processes) holds the directory's owner lock."""

    def __init__(self, path: str, holders: list[tuple[int, bool]]) -> None:
        self.path = path
        self.holders = holders
        who = ", ".join(f"pid {pid}" for pid, _ in holders) or "another process (pid unknown)"
        how = ("exclusively: a running store" if all(ex for _, ex in holders)
               else "shared: processes using it through shared_ssd")
        super().__init__(
            f"{path} is in use by {who} ({how}); inspecting it now would read files being changed. "
            "Stop the store first, or pass --force for a read-only look at a directory in use "
            "(the results may then be inconsistent).")


class FileNote(msgspec.Struct):
    file: str  # relative to the inspected directory
    reason: str


class Damage(msgspec.Struct):
    """One record a store would not serve because its bytes are wrong (or cannot be read)."""

    file: str  # relative to the inspected directory
    offset: int  # of the record's header block in ``file``
    key: str | None  # None when the key itself cannot be read
    reason: str


class InspectReport(msgspec.Struct):
    path: str
    backend: str | None  # None: no backend's files are here (an empty or new directory)
    objects: int = 0  # objects a store opened here would serve
    value_bytes: int = 0  # their values
    record_bytes: int = 0  # their records (header block and padding included)
    dead_records: int = 0  # records on disk a store would not serve (superseded, removed)
    files: int = 0  # regular files under the directory, every kind
    file_bytes: int = 0  # their sizes
    allocated_bytes: int = 0  # blocks the file system has allocated for them
    capacity_bytes: int | None = None  # recorded at creation (offset: the data file's size); None: not recorded
    unreadable: list[FileNote] = []  # files, directories or blocks that could not be read (left alone)
    pending_cleanup: list[FileNote] = []  # what an open would delete (temporary files, emptied buckets)
    footer_damaged: list[str] = []  # bucket files whose footer is damaged (their records found by scanning)
    verified: bool = False
    verified_objects: int = 0
    damaged: list[Damage] = []
    in_use_by: list[int] = []  # pids holding the owner lock while it was read (only with force)
    consistent: bool = True  # False when read while in use
    notes: list[str] = []

    @property
    def healthy(self) -> bool:
        """No damaged record and no unreadable file."""
        return not self.damaged and not self.unreadable


class _Live(msgspec.Struct, array_like=True):
    key: str
    file: str
    offset: int
    value_len: int
    seq: int


class _Found(msgspec.Struct):
    live: list[_Live] = []
    seed: int = 0  # header seed of the backend's records


def detect_backends(directory: str) -> list[str]:
    """The backends whose files are in ``directory`` (usually one; none for an empty directory)."""
    names = os.listdir(directory)
    out = []
    if bucket.TOMBSTONE_FILE in names or any(bucket.bucket_file_id(n) for n in names):
        out.append("bucket")
    if offset.FILE_NAME in names or offset.FILE_NAME + ".tmp" in names:
        out.append("offset")
    if any(len(n) == 2 and set(n) <= _HEX and os.path.isdir(os.path.join(directory, n)) for n in names):
        out.append("file")
    return out


def inspect_directory(directory: str, *, verify: bool = False, force: bool = False,
                      backend: str | None = None, on_progress: Progress | None = None) -> InspectReport:
    """Inspect the SSD directory ``directory`` without changing it (see the module docstring).

    ``backend`` skips detection. ``verify`` reads and checks every served record, calling
    ``on_progress`` after each batch. Raises :class:`DirectoryInUse` when a store holds the
    directory and not ``force``, :class:`InspectError` when the directory cannot be inspected.
    """
    path = os.path.abspath(directory)
    if not os.path.exists(path):
        raise InspectError(f"{directory}: no such directory")
    if not os.path.isdir(path):
        raise InspectError(f"{directory}: not a directory")
    if backend is not None and backend not in BACKENDS:
        raise InspectError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    had_note = os.path.exists(os.path.join(path, LOCK_FILE))
    lock_fds, in_use, holders = _take_locks(path, force)
    try:
        report = InspectReport(path=path, backend=None)
        if in_use:
            report.in_use_by = [pid for pid, _ in holders]
            report.consistent = False
            who = ", ".join(f"pid {p}" for p in report.in_use_by) or "another process (pid unknown)"
            report.notes.append(f"read while in use by {who} (--force): objects written, evicted or removed "
                                "meanwhile may be miscounted or reported damaged")
        elif not had_note:
            report.notes.append(f"no {LOCK_FILE}: no store has opened this directory, or it was copied "
                                "without it (none was made)")
        if backend is None:
            try:
                found = detect_backends(path)
            except OSError as e:
                raise InspectError(f"{directory}: cannot list it: {e.strerror}") from None
            if len(found) > 1:
                raise InspectError(f"{directory} holds files of several backends ({', '.join(found)}); "
                                   "choose one with --backend")
            backend = found[0] if found else None
        report.backend = backend
        _disk_usage(path, report)
        if backend is not None:
            contents = _READERS[backend](path, report, in_use)
            report.objects = len(contents.live)
            report.value_bytes = sum(r.value_len for r in contents.live)
            report.record_bytes = sum(record_bytes(r.value_len) for r in contents.live)
            if verify:
                _verify(path, contents, report, in_use, on_progress)
        report.verified = verify
        return report
    finally:
        for fd in lock_fds:
            os.close(fd)  # drops the locks; the files are left as they were


def _take_locks(path: str, force: bool) -> tuple[list[int], bool, list[tuple[int, bool]]]:
    """Lock the directory itself and its owner note (when there is one) exclusively, as a store
    does, both opened read-only and nothing created: (descriptors holding the locks, whether
    another process holds either, who). Raises :class:`DirectoryInUse` for a held one unless
    ``force``."""
    note = os.path.join(path, LOCK_FILE)
    fds: list[int] = []
    try:
        for target, flags in ((path, os.O_DIRECTORY), (note, 0)):
            try:
                fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | flags)  # never O_CREAT: leave no file behind
            except FileNotFoundError:
                continue  # no note: no store has opened the directory, or it was copied without one
            except OSError as e:
                raise InspectError(f"{path}: cannot open {target}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                try:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise InspectError(f"{path}: cannot lock {target}: {e.strerror}") from None
                    holders = flock_holders(fd) or _pid_in_note(note)
                finally:
                    os.close(fd)
                if not force:
                    raise DirectoryInUse(path, holders)
                for held in fds:
                    os.close(held)
                return [], True, holders
            fds.append(fd)
    except BaseException:
        for held in fds:
            os.close(held)
        raise
    return fds, False, []


def _pid_in_note(note: str) -> list[tuple[int, bool]]:
    """The pid an exclusive owner wrote into its note (when /proc/locks says nothing)."""
    try:
        with open(note, "rb") as f:
            pid = int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return []
    return [(pid, True)] if pid > 0 else []


def _disk_usage(path: str, report: InspectReport) -> None:
    def unreadable(e: OSError) -> None:
        report.unreadable.append(FileNote(os.path.relpath(e.filename or path, path), e.strerror or str(e)))

    for root, _dirs, names in os.walk(path, onerror=unreadable):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            except OSError as e:
                unreadable(e)
                continue
            if stat.S_ISREG(st.st_mode):
                report.files += 1
                report.file_bytes += st.st_size
                report.allocated_bytes += st.st_blocks * 512


# -- one reader per backend: what a store opened here would serve ---------------------------------

def _read_bucket(path: str, report: InspectReport, in_use: bool) -> _Found:
    found: dict[int, list] = {}  # bucket id -> footer entries
    names: dict[int, str] = {}
    for name in sorted(os.listdir(path)):
        named = bucket.bucket_file_id(name)
        if named is None:
            continue
        bid, tmp = named
        if tmp:
            report.pending_cleanup.append(FileNote(name, "a bucket write that never finished (an open deletes it)"))
            continue
        try:
            fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                entries = bucket.read_footer(fd, bid, size)
                if entries is None:
                    report.footer_damaged.append(name)
                    entries, dropped = bucket.scan_records(fd, size)
                    for off, key in dropped:
                        report.damaged.append(Damage(name, off, key.decode(errors="replace"),
                                                     "cut short or bad checksum (found scanning a damaged footer)"))
            finally:
                os.close(fd)
        except OSError as e:
            if in_use and e.errno == errno.ENOENT:
                continue  # removed by the store using the directory
            report.unreadable.append(FileNote(name, e.strerror or str(e)))
            continue
        if not entries:
            report.pending_cleanup.append(FileNote(name, "no valid records (an open deletes it)"))
            continue
        found[bid] = entries
        names[bid] = name
    winners = bucket.live_records(found, bucket.read_tombstones(path))
    live_per_bucket = {bid: 0 for bid in found}
    live = []
    for key, (bid, e) in winners.items():
        live_per_bucket[bid] += 1
        live.append(_Live(key, names[bid], e.offset, e.value_len, e.seq))
    for bid, n in live_per_bucket.items():
        if n == 0:
            report.pending_cleanup.append(FileNote(names[bid], "every key removed or superseded (an open deletes it)"))
    report.dead_records = sum(len(es) for es in found.values()) - len(winners)
    return _Found(live=live)


def _read_offset(path: str, report: InspectReport, in_use: bool) -> _Found:
    name = offset.FILE_NAME
    if os.path.exists(os.path.join(path, name + ".tmp")):
        report.pending_cleanup.append(FileNote(name + ".tmp", "a data file create that never finished "
                                                              "(an open deletes it)"))
    data = os.path.join(path, name)
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Found()
    except OSError as e:
        report.unreadable.append(FileNote(name, e.strerror or str(e)))
        return _Found()
    try:
        sb = offset.decode_superblock(os.pread(fd, ALIGN, 0))
        size = align_down(os.fstat(fd).st_size)
    except OSError as e:
        report.unreadable.append(FileNote(name, e.strerror or str(e)))
        return _Found()
    finally:
        os.close(fd)
    if sb is None:
        report.unreadable.append(FileNote(name, "bad superblock: not an offset-backend data file "
                                                "(an open refuses it)"))
        return _Found()
    seed, created_bytes = sb
    report.capacity_bytes = created_bytes
    try:
        found, bad = offset.scan_records(data, seed, size)
    except OSError as e:
        report.unreadable.append(FileNote(name, e.strerror or str(e)))
        return _Found(seed=seed)
    report.unreadable += [FileNote(f"{name}@{off}", "unreadable block (skipped)") for off in bad]
    best, losers = offset.pick_winners(found)
    report.dead_records = len(losers)
    live = [_Live(key.decode(errors="replace"), name, off, value_len, seq)
            for off, value_len, seq, key in sorted(best.values(), key=lambda r: r[0])]
    return _Found(live=live, seed=seed)


def _read_file(path: str, report: InspectReport, in_use: bool) -> _Found:
    found: list[tuple[int, str, str, int]] = []  # seq, key, relative path, value_len
    for top in sorted(os.listdir(path)):
        if len(top) != 2 or not os.path.isdir(os.path.join(path, top)):
            continue
        for sub in sorted(_listdir(path, top, report)):
            if len(sub) != 2 or not os.path.isdir(os.path.join(path, top, sub)):
                continue
            for name in sorted(_listdir(path, f"{top}/{sub}", report)):
                rel = f"{top}/{sub}/{name}"
                kind = file_per_key.record_file_kind(name)
                if kind == "tmp":
                    report.pending_cleanup.append(FileNote(rel, "a write that never finished (an open deletes it)"))
                    continue
                if kind != "rec":
                    continue
                full = os.path.join(path, rel)
                try:
                    rec = file_per_key.read_record_header(full)
                except OSError as e:
                    report.unreadable.append(FileNote(rel, e.strerror or str(e)))
                    continue
                if rec is None:
                    if in_use and not os.path.exists(full):
                        continue  # removed by the store using the directory
                    report.damaged.append(Damage(rel, 0, None, "header not valid or file cut short "
                                                               "(an open deletes this file)"))
                    continue
                found.append((rec[0], rec[1], rel, rec[2]))
    # The recovery rule: oldest first, a later record of the same key replaces (and deletes) an older one.
    index: dict[str, _Live] = {}
    for seq, key, rel, value_len in sorted(found):
        old = index.get(key)
        if old is not None:
            report.dead_records += 1
            report.pending_cleanup.append(FileNote(old.file, "an older copy of a key (an open deletes it)"))
        index[key] = _Live(key, rel, 0, value_len, seq)
    return _Found(live=list(index.values()))


def _listdir(path: str, rel: str, report: InspectReport) -> list[str]:
    try:
        return os.listdir(os.path.join(path, rel))
    except OSError as e:
        report.unreadable.append(FileNote(rel, e.strerror or str(e)))
        return []


_READERS: dict[str, Callable[[str, InspectReport, bool], _Found]] = {
    "bucket": _read_bucket,
    "offset": _read_offset,
    "file": _read_file,
}


# -- verification ----------------------------------------------------------------------------------

def _batches(live: list[_Live]) -> list[list[_Live]]:
    out: list[list[_Live]] = []
    nbytes = 0
    for r in sorted(live, key=lambda r: (r.file, r.offset)):  # file order: sequential reads
        if not out or len(out[-1]) >= _VERIFY_BATCH_RECORDS or (nbytes + r.value_len > _VERIFY_BATCH_BYTES and out[-1]):
            out.append([])
            nbytes = 0
        out[-1].append(r)
        nbytes += r.value_len
    return out


def _verify(path: str, contents: _Found, report: InspectReport, in_use: bool, on_progress: Progress | None) -> None:
    """Read every live record and check it as ``get_into`` does; damaged ones go to the report.

    ``in_use``: read without the lock while an owner changes the directory, so a file gone is an
    object it removed or evicted, not damage."""
    total = sum(r.value_len for r in contents.live)
    done = 0
    if on_progress is not None:
        on_progress(0, total)
    engine = PosixEngine(threads=2)
    try:
        for batch in _batches(contents.live):
            dest = aligned_buffer(max(1, sum(r.value_len for r in batch)))
            fds: dict[str, int] = {}
            reads: list[RecordRead] = []
            checked: list[_Live] = []
            try:
                pos = 0
                for r in batch:
                    fd = fds.get(r.file)
                    if fd is None:
                        try:
                            fd = fds[r.file] = os.open(os.path.join(path, r.file), os.O_RDONLY | os.O_CLOEXEC)
                        except FileNotFoundError:
                            if not in_use:
                                report.damaged.append(Damage(r.file, r.offset, r.key, "file is gone"))
                            continue
                        except OSError as e:
                            report.damaged.append(Damage(r.file, r.offset, r.key, f"cannot open: {e.strerror}"))
                            continue
                    reads.append(RecordRead(fd, r.offset, r.key.encode(), r.value_len, r.seq,
                                            dest[pos:pos + r.value_len]))
                    checked.append(r)
                    pos += r.value_len
                statuses = read_records(engine, reads, contents.seed)
            finally:
                for fd in fds.values():
                    os.close(fd)
            for r, st in zip(checked, statuses):
                if st is Status.OK:
                    report.verified_objects += 1
                elif st is Status.CORRUPT:
                    report.damaged.append(Damage(r.file, r.offset, r.key,
                                                 "checksum, key, length or sequence number does not match"))
                else:
                    report.damaged.append(Damage(r.file, r.offset, r.key, "read error"))
            done += sum(r.value_len for r in batch)
            if on_progress is not None:
                on_progress(done, total)
    finally:
        engine.close()
