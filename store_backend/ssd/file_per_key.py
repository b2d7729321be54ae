"""The file-per-key SSD backend: one record file per object, for debugging and inspection.

A key never becomes a path: its file is named by the xxh3_128 of its UTF-8 bytes, under a two-level
fan-out (``ab/cd/abcd….rec``), so keys such as ``"../../etc/passwd"`` or ``"/abs"`` stay inside the
directory. The key is stored in the record header; two keys with the same hash (never seen in
practice) get names ``….rec``, ``….1.rec``, … and every read checks the key it finds.

A put writes each object to a temporary file, syncs it, renames it into place and syncs the
directories it touched: a file is there whole or not at all. Opening the directory reads every
record's header block to rebuild the index (and deletes leftover temporary files: each writer thread
names its own, ``<record>.<pid>-<thread id>.tmp``, and in a shared directory one is deleted only
when its writer is gone, or when it is very old). When a put would
pass ``capacity_bytes``, or the file system's use would pass ``disk_watermark`` of its size, whole
objects are evicted first (FIFO or LRU, ``bucket_eviction``); a write that still meets ENOSPC evicts
what it needs in the same order and is tried again (twice at most).

The directory is locked by its owner (see :mod:`store_backend.ownership`); with ``shared`` the lock
is a shared one, for :mod:`store_backend.ssd.shared_directory`.

Thread-safe: one lock guards the index; file I/O runs outside it. A file deleted while being read
stays readable through the reader's descriptor.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import xxhash

from store_backend.config import ConfigError, SsdConfig
from store_backend.ownership import pid_alive
from store_backend.private import make_private_dirs, open_private
from store_backend.ssd.base import SsdStats
from store_backend.ssd.directory import direct_io_usable, fs_room, open_directory
from store_backend.ssd.indexed import IndexedBackend
from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.requests import (
    IoRequest,
    aligned_buffer,
    fsync_dir,
)
from store_backend.ssd.record import (
    HEADER_BLOCK,
    RecordRead,
    decode_header,
    encode_header,
    read_records,
    record_bytes,
    status_for_errno,
    value_checksum,
    write_buffers,
)
from store_backend.types import (
    Buffer,
    ReadResult,
    Status,
    byte_view,
    check_batch,
    check_key,
)

logger = logging.getLogger(__name__)

_ENOSPC_RETRIES = 2  # write passes after the first one that met a full file system
_REC = re.compile(r"^[0-9a-f]{32}(\.[0-9]+)?\.rec$")
# "<record name>.<pid>-<thread id>.tmp": each writer has its own (two processes sharing the
# directory may write one key at once); the older "<record name>.tmp" is still recognised.
_TMP = re.compile(r"^[0-9a-f]{32}(\.[0-9]+)?\.rec(?:\.([0-9]+)-[0-9]+)?\.tmp$")
# In a shared directory a temporary file is deleted at open only when its writer is gone and it is
# this old (a pid from another pid namespace may look dead), or when it is older than the second
# bound whoever wrote it: no write stays in flight that long.
_STALE_TMP_S = 60.0
_ABANDONED_TMP_S = 3600.0


def temp_path(path: str) -> str:
    """This thread's temporary name for the record file ``path`` (renamed onto it when durable)."""
    return f"{path}.{os.getpid()}-{threading.get_native_id()}.tmp"


def record_file_kind(name: str) -> str | None:
    """``"rec"`` for a record file's name, ``"tmp"`` for a temporary one (deleted at open), else None."""
    if _REC.match(name):
        return "rec"
    return "tmp" if _TMP.match(name) else None


def read_record_header(path: str) -> tuple[int, str, int] | None:
    """(seq, key, value_len) from the record file at ``path``; None when it is gone or its header
    is not valid (torn, damaged, cut short, a key that is not UTF-8). Raises OSError when it cannot
    be read. Reads only (recovery uses it; so does :mod:`store_backend.ssd.inspect`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        h = decode_header(os.pread(fd, HEADER_BLOCK, 0))
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if h is None or size < HEADER_BLOCK + h.value_len:
        return None
    try:
        return h.seq, h.key.decode(), h.value_len
    except UnicodeDecodeError:
        return None


class _Entry(msgspec.Struct):
    path: str
    value_len: int
    seq: int

    @property
    def nbytes(self) -> int:
        return record_bytes(self.value_len)


class FilePerKeyBackend(IndexedBackend):
    """See the module docstring. ``engine`` does the file I/O; closed by ``close()`` when owned."""

    name = "file"

    def __init__(self, cfg: SsdConfig, engine: IoEngine, *, owns_engine: bool = False,
                 shared: bool = False) -> None:
        """``shared``: other processes use the directory too (a shared lock instead of an
        exclusive one; see :mod:`store_backend.ssd.shared_directory`)."""
        self.cfg = cfg
        self._engine = engine
        self._owns_engine = owns_engine
        self._owner = open_directory(cfg, shared=shared)
        self._shared = shared
        self._root = os.path.realpath(cfg.path)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._paths: set[str] = set()  # names in use or being written
        self._pending: set[str] = set()
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._seq = 1
        self._stats = SsdStats(capacity_bytes=cfg.capacity_bytes)
        self._closed = False
        try:
            self._direct = direct_io_usable(cfg, "file-per-key")
            self._recover()
        except BaseException as e:
            self._owner.release()
            if isinstance(e, OSError):
                raise ConfigError(f"ssd.path={cfg.path!r}: cannot open the file backend: {e}") from None
            raise

    def path_for(self, key: str, n: int = 0) -> str:
        """The file of ``key`` (``n``: collision suffix). Always inside the root directory."""
        h = xxhash.xxh3_128_hexdigest(key.encode())
        name = f"{h}.rec" if n == 0 else f"{h}.{n}.rec"
        return os.path.join(self._root, h[:2], h[2:4], name)

    # -- recovery ----------------------------------------------------------------------------------
    def _recover(self) -> None:
        found: list[tuple[int, str, str, int]] = []  # seq, key, path, value_len
        for top in sorted(os.listdir(self._root)):
            d1 = os.path.join(self._root, top)
            if len(top) != 2 or not os.path.isdir(d1):
                continue
            for sub in sorted(self._listdir(d1)):
                d2 = os.path.join(d1, sub)
                if len(sub) != 2 or not os.path.isdir(d2):
                    continue
                for name in self._listdir(d2):
                    path = os.path.join(d2, name)
                    m = _TMP.match(name)
                    if m:
                        self._drop_temporary(path, m.group(2))
                    elif _REC.match(name):
                        try:
                            rec = self._read_header(path)
                        except OSError as e:
                            # One bad file must not keep the store closed: it stays (for inspection)
                            # and its object is a miss.
                            self._stats.unreadable_files += 1
                            logger.error("file-per-key backend: skipping unreadable %s: %s", path, e)
                            continue
                        if rec is None:
                            self._stats.discarded_records += 1
                            os.unlink(path)
                        else:
                            found.append((rec[0], rec[1], path, rec[2]))
        for seq, key, path, value_len in sorted(found):  # oldest first: the eviction order
            old = self._index.get(key)
            if old is not None:  # a duplicate cannot be written by put; keep the newer one
                os.unlink(old.path)
                self._paths.discard(old.path)
                self._used_bytes -= old.nbytes
            self._index[key] = _Entry(path, value_len, seq)
            self._paths.add(path)
            self._used_bytes += record_bytes(value_len)
            self._seq = max(self._seq, seq + 1)
        self._stats.recovered_objects = len(self._index)
        if found:
            logger.info("file-per-key backend at %s: recovered %d objects", self._root, len(self._index))

    def _drop_temporary(self, path: str, pid: str | None) -> None:
        """Delete a temporary file left by a write that never finished (never renamed into
        place, so never acknowledged). With the directory to ourselves every one is such a file;
        shared, one of another live process may be a write in flight and stays."""
        if self._shared:
            try:
                age_s = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                return
            gone = pid is not None and not pid_alive(int(pid))
            if not ((gone and age_s > _STALE_TMP_S) or age_s > _ABANDONED_TMP_S):
                return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another process of the pair cleaned it up first

    def _listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except OSError as e:
            self._stats.unreadable_files += 1
            logger.error("file-per-key backend: skipping unreadable directory %s: %s", path, e)
            return []

    @staticmethod
    def _read_header(path: str) -> tuple[int, str, int] | None:
        return read_record_header(path)

    # -- put ---------------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        """Write new objects; blocks until every object reported OK is durable. Thread-safe.

        Room is made by the eviction order for ``capacity_bytes`` and for ``disk_watermark`` of
        the file system; a write that still meets a full file system (ENOSPC) evicts as many bytes
        as it needs, in the same order, and is tried again (twice at most)."""
        check_batch(keys, buffers)
        return self._put(keys, buffers)

    def _put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        out, full = self._put_once(keys, buffers)
        for _attempt in range(_ENOSPC_RETRIES):
            if not full:
                break
            need = sum(record_bytes(byte_view(buffers[i]).nbytes) for i in full)
            with self._lock:
                victims = self._evict_bytes(need)
            if not victims:
                break
            logger.warning("file-per-key backend at %s: file system full; evicted %d objects to write %d",
                           self._root, len(victims), len(full))
            self._unlink([e.path for e in victims])
            again, full_again = self._put_once([keys[i] for i in full], [buffers[i] for i in full])
            for i, st in zip(full, again):
                out[i] = st
            full = [full[j] for j in full_again]
        return out

    def _put_once(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> tuple[list[Status], list[int]]:
        """One pass of ``put``: the statuses, and the indices whose write met a full file system."""
        out = [Status.OK] * len(keys)
        todo: dict[int, tuple[memoryview, str, int]] = {}  # index -> value, final path, seq
        victims: list[_Entry] = []
        room = fs_room(self._root, self.cfg.disk_watermark)  # asked before the lock: a system call
        fs_over = 0 if room is None else room[0] - room[1]  # bytes the file system is past its mark
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if check_key(key) is not None:
                    out[i] = Status.INVALID_KEY
                    continue
                v = byte_view(buffers[i])
                need = record_bytes(v.nbytes)
                if need > self.cfg.capacity_bytes:
                    out[i] = Status.TOO_LARGE
                    continue
                if key in self._index or key in self._pending:
                    out[i] = Status.EXISTS
                    continue
                for_capacity = self._evict_for(need)
                victims += for_capacity
                fs_over -= sum(e.nbytes for e in for_capacity)
                if self._used_bytes + self._reserved_bytes + need > self.cfg.capacity_bytes:
                    out[i] = Status.NO_SPACE
                    continue
                if room is not None and fs_over + need > 0:
                    # Only when eviction can bring the file system under its mark: a disk full of
                    # other files costs this put, not the objects stored.
                    if fs_over + need > self._used_bytes:
                        out[i] = Status.NO_SPACE
                        continue
                    more = self._evict_bytes(fs_over + need)
                    victims += more
                    fs_over -= sum(e.nbytes for e in more)
                fs_over += need
                n = 0
                while self.path_for(key, n) in self._paths:
                    n += 1
                path = self.path_for(key, n)
                self._paths.add(path)
                self._pending.add(key)
                self._reserved_bytes += need
                todo[i] = (v, path, self._seq)
                self._seq += 1
        self._unlink([e.path for e in victims])
        if not todo:
            return out, []
        results: dict[int, int] = {}
        try:
            results = self._write(keys, todo)
        finally:
            with self._lock:
                for i, (v, path, seq) in todo.items():
                    self._reserved_bytes -= record_bytes(v.nbytes)
                    self._pending.discard(keys[i])
                    if results.get(i, -errno.EIO) == 0:
                        self._index[keys[i]] = _Entry(path, v.nbytes, seq)
                        self._used_bytes += record_bytes(v.nbytes)
                    else:
                        self._paths.discard(path)
                        out[i] = status_for_errno(-results.get(i, -errno.EIO))
        return out, [i for i in todo if -results.get(i, -errno.EIO) in (errno.ENOSPC, errno.EDQUOT)]

    def _evict_bytes(self, nbytes: int) -> list[_Entry]:
        """Under the lock: drop objects in eviction order until ``nbytes`` are freed (or none is left)."""
        victims = []
        while self._index and nbytes > 0:
            key, e = self._index.popitem(last=False)
            self._note_evicted((key,))
            self._used_bytes -= e.nbytes
            self._paths.discard(e.path)
            victims.append(e)
            nbytes -= e.nbytes
        self._stats.evictions += len(victims)
        return victims

    def _evict_for(self, need: int) -> list[_Entry]:
        """Under the lock: drop the oldest (or least recently read) objects until ``need`` fits."""
        victims = []
        while self._index and self._used_bytes + self._reserved_bytes + need > self.cfg.capacity_bytes:
            key, e = self._index.popitem(last=False)
            self._note_evicted((key,))
            self._used_bytes -= e.nbytes
            self._paths.discard(e.path)
            victims.append(e)
        self._stats.evictions += len(victims)
        return victims

    def _write(self, keys: Sequence[str], todo: dict[int, tuple[memoryview, str, int]]) -> dict[int, int]:
        """Temp file per object, one batched write, one batched sync, renames, directory syncs."""
        results: dict[int, int] = {}
        fds: dict[int, int] = {}
        headers = aligned_buffer(len(todo) * HEADER_BLOCK)
        requests: list[IoRequest] = []
        order: list[int] = []
        new_dirs: set[str] = set()
        tmps = {i: temp_path(path) for i, (_v, path, _seq) in todo.items()}
        try:
            for k, (i, (v, path, seq)) in enumerate(todo.items()):
                try:
                    d = os.path.dirname(path)
                    if not os.path.isdir(d):
                        make_private_dirs(d, self._root)  # 0700, as the directory itself
                        new_dirs.update((d, os.path.dirname(d)))
                    fds[i] = open_private(tmps[i], os.O_CREAT | os.O_TRUNC | os.O_WRONLY |
                                          (os.O_DIRECT if self._direct else 0))
                except OSError as e:
                    results[i] = -(e.errno or errno.EIO)
                    continue
                key_b = keys[i].encode()
                block = headers[k * HEADER_BLOCK:(k + 1) * HEADER_BLOCK]
                encode_header(block, key_b, v.nbytes, seq, value_checksum(key_b, v))
                requests.append(IoRequest(fds[i], 0, write_buffers(block, v)))
                order.append(i)
            for i, r in zip(order, self._engine.write(requests)):
                results[i] = r if r < 0 else 0
            written = [i for i in order if results[i] == 0]
            for i, r in zip(written, self._engine.sync([fds[i] for i in written])):
                results[i] = r
        finally:
            for fd in fds.values():
                os.close(fd)
        dirs: set[str] = set()
        for i, (v, path, seq) in todo.items():
            if results.get(i) == 0:
                try:
                    os.rename(tmps[i], path)
                    dirs.add(os.path.dirname(path))
                    continue
                except OSError as e:
                    results[i] = -(e.errno or errno.EIO)
            try:
                os.unlink(tmps[i])
            except FileNotFoundError:
                pass
        try:
            for d in sorted(dirs | new_dirs, key=len, reverse=True):  # leaves first, then parents
                fsync_dir(d)
            if new_dirs:
                fsync_dir(self._root)
        except OSError as e:
            logger.error("directory sync under %s failed: %s", self._root, e)
            for i in results:
                if results[i] == 0:
                    results[i] = -(e.errno or errno.EIO)
        return results

    def _unlink(self, paths: list[str]) -> None:
        dirs = set()
        for p in paths:
            try:
                os.unlink(p)
                dirs.add(os.path.dirname(p))
            except FileNotFoundError:
                pass
        for d in dirs:
            try:
                fsync_dir(d)
            except OSError as e:
                logger.error("directory sync of %s failed: %s", d, e)

    # -- get ---------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """Copy objects into the caller's buffers, verifying each; CORRUPT ones are dropped."""
        check_batch(keys, buffers)
        out = [ReadResult(Status.NOT_FOUND)] * len(keys)
        want: list[tuple[int, _Entry, memoryview]] = []
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
                if lru:
                    self._index.move_to_end(key)
                want.append((i, e, dest))
        reads: list[tuple[int, _Entry, RecordRead]] = []
        fds: list[int] = []
        try:
            for i, e, dest in want:
                try:
                    fd = os.open(e.path, os.O_RDONLY | (os.O_DIRECT if self._direct else 0))
                except FileNotFoundError:  # removed or evicted since the lookup
                    continue
                except OSError as err:
                    logger.error("cannot open %s: %s", e.path, err)
                    out[i] = ReadResult(Status.IO_ERROR)
                    continue
                fds.append(fd)
                reads.append((i, e, RecordRead(fd, 0, keys[i].encode(), e.value_len, e.seq, dest)))
            statuses = read_records(self._engine, [r for _, _, r in reads])
        finally:
            for fd in fds:
                os.close(fd)
        corrupt: list[str] = []
        for (i, e, r), st in zip(reads, statuses):
            out[i] = ReadResult(st, r.value_len if st is Status.OK else 0)
            if st is Status.CORRUPT:
                corrupt.append(keys[i])
        if corrupt:
            logger.warning("%d corrupt records in %s dropped", len(corrupt), self._root)
            with self._lock:
                self._stats.corrupt_reads += len(corrupt)
            self._drop(corrupt, expect={keys[i]: e for i, e, _ in reads})
        return out

    # -- remove and queries ------------------------------------------------------------------------
    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Remove objects durably (their files are unlinked and the directory synced)."""
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        valid = []
        for i, key in enumerate(keys):
            if check_key(key) is not None:
                out[i] = Status.INVALID_KEY
            else:
                valid.append(i)
        gone = self._drop([keys[i] for i in valid])
        for i in valid:
            if keys[i] in gone:
                out[i] = Status.OK
        return out

    def _drop(self, keys: list[str], expect: dict[str, _Entry] | None = None) -> set[str]:
        victims: list[_Entry] = []
        gone: set[str] = set()
        with self._lock:
            self._check_open()
            for key in keys:
                e = self._index.get(key)
                if e is None or (expect is not None and expect.get(key) is not e):
                    continue
                del self._index[key]
                self._paths.discard(e.path)
                self._used_bytes -= e.nbytes
                victims.append(e)
                gone.add(key)
        self._unlink([e.path for e in victims])
        return gone

    def close(self, timeout_s: float | None = None) -> int:
        """Close the engine when owned (waiting at most ``timeout_s`` for its threads), then give up
        the directory's lock. Idempotent; no call may be in flight. Returns how many engine
        threads were still in I/O: the lock is then kept (they may still write in the directory)."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        stuck = int(self._engine.close(timeout_s) or 0) if self._owns_engine else 0
        if stuck:
            logger.warning("file backend %s: %d io thread(s) still running at close; its directory lock "
                           "is kept for them", self.cfg.path, stuck)
            return stuck
        self._owner.release()
        return 0
