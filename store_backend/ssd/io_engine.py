"""Batched file I/O for the SSD tier: io_uring through raw syscalls, POSIX preadv/pwritev as fallback.

Who calls it: the SSD backends (the store's offload/promotion workers and readers on the get path,
any thread) and :mod:`store_backend.ssd.raw_bench`. Both engines are thread-safe: the io_uring
engine gives every calling thread a private ring (``threading.local``), the POSIX engine runs a
batch on a bounded thread pool it starts on first use.

A request is one contiguous file range read into (or written from) a list of buffers in file
order (scatter/gather). On a file opened with ``O_DIRECT`` the engine handles any alignment
transparently: the block-aligned part of a buffer whose address is congruent to its file position
goes straight to the device; head and tail pieces, and buffers that are not congruent at all, go
through aligned bounce memory (the thread's staging area, registered with the ring as a fixed
buffer, or a temporary mapping for a request larger than the staging area), copied after a read
or before a write. A write whose file range does not start or end on a block boundary reads the
edge blocks first (read-modify-write; two concurrent unaligned writes sharing a block therefore
race, as on any block device), except that the last partial block of a write that extends the file
goes through the page cache (a second descriptor of the same file), so the file ends exactly at
the end of the write.

The io_uring engine does not use liburing (the PyPI package dies with SIGILL on CPUs without
AVX-512, and the Debian library is not on a fresh machine): it calls ``io_uring_setup``,
``io_uring_enter`` and ``io_uring_register`` through ``ctypes``, maps the rings itself and fills
the submission entries (READ/WRITE, READV/WRITEV, READ_FIXED/WRITE_FIXED, FSYNC) by hand. The ring
protocol's memory ordering is satisfied on x86-64 by the total store order plus the syscall that
precedes every read of the completion ring.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from store_backend.types import Buffer, byte_view

logger = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment used for addresses, lengths and file offsets
IOV_MAX = 1024  # Linux UIO_MAXIOV: most iovecs one preadv/pwritev/READV may carry
DEFAULT_STAGING_BYTES = 4 << 20  # per thread; larger bounces use a temporary mapping
# Bytes of requests in flight per ring, on top of the queue depth. A few tens of MiB keep a disk
# busy; beyond that, large requests would all finish together and their completion work (checksums)
# could no longer overlap the I/O of the next ones.
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20

# on_complete(request_index, result): called in the submitting thread as each request finishes.
Completion = Callable[[int, int], None]


class IoRequest(NamedTuple):
    """One contiguous file range: ``buffers`` (in file order) are read into or written from."""

    fd: int
    offset: int
    buffers: Sequence[Buffer]


@runtime_checkable
class IoEngine(Protocol):
    """Batched positional I/O. Results are bytes transferred (>= 0) or ``-errno``, one per request.

    Calls block until every request of the batch has finished. The caller owns the buffers; the
    engine uses them only during the call. Requests of one batch run concurrently (up to the
    engine's queue depth): they must not overlap when any of them writes.
    """

    name: str

    def read(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        """Fill each request's buffers from the file; a result below the length means EOF."""
        ...

    def write(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        """Write each request's buffers to the file (not yet durable: call ``sync``)."""
        ...

    def sync(self, fds: Sequence[int], *, datasync: bool = True) -> list[int]:
        """fdatasync (or fsync) every fd, concurrently; 0 or ``-errno`` per fd."""
        ...

    def close(self) -> None:
        """Release rings, staging memory and threads. Idempotent; no call may be in flight."""
        ...


# -- helpers shared by the backends ----------------------------------------------------------------

def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) & ~(a - 1)


def align_down(n: int, a: int = ALIGN) -> int:
    return n & ~(a - 1)


def aligned_buffer(nbytes: int) -> memoryview:
    """Zeroed, page-aligned writable memory (an anonymous mapping freed with its last view)."""
    return memoryview(mmap.mmap(-1, max(ALIGN, align_up(nbytes))))[:nbytes]


def buffer_address(buf: Buffer) -> int:
    """Address of a buffer's first byte (read-only buffers included)."""
    mv = byte_view(buf)
    if mv.nbytes == 0:
        return 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def probe_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs before 6.6, ramfs: no)."""
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        ok = False
    else:
        os.close(fd)
        ok = True
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return ok


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- request planning: alignment, bounce buffers, iovec split --------------------------------------

class _Bounce:
    """Aligned scratch memory for one request: a slice of a staging area or a temporary mapping."""

    __slots__ = ("view", "addr", "fixed", "_release")

    def __init__(self, view: memoryview, addr: int, fixed: bool, release: Callable[[], None] | None) -> None:
        self.view = view
        self.addr = addr
        self.fixed = fixed  # inside the ring's registered buffer: READ_FIXED/WRITE_FIXED may be used
        self._release = release

    def release(self) -> None:
        self.view.release()
        if self._release is not None:
            self._release()
            self._release = None


class _Staging:
    """Per-thread aligned staging area with a tiny first-fit allocator (block granularity)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(max(nbytes, ALIGN))
        self._map = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._map)
        self.addr = buffer_address(self.view)
        self._free: list[list[int]] = [[0, self.nbytes]]  # sorted [offset, length]
        self.fixed = False

    def alloc(self, nbytes: int) -> _Bounce | None:
        nbytes = align_up(nbytes)
        for i, ext in enumerate(self._free):
            if ext[1] >= nbytes:
                off = ext[0]
                if ext[1] == nbytes:
                    del self._free[i]
                else:
                    ext[0] += nbytes
                    ext[1] -= nbytes
                return _Bounce(self.view[off:off + nbytes], self.addr + off, self.fixed,
                               lambda: self._give_back(off, nbytes))
        return None

    def _give_back(self, off: int, nbytes: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, [off, nbytes])
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1][1] += free.pop(i)[1]

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            logger.debug("staging area still referenced at close; left to the garbage collector")


def _temp_bounce(nbytes: int) -> _Bounce:
    m = mmap.mmap(-1, align_up(max(nbytes, ALIGN)))
    view = memoryview(m)
    return _Bounce(view, buffer_address(view), False, m.close)


class _Part(NamedTuple):
    """One syscall's worth of a plan: a contiguous file range and its iovecs (≤ IOV_MAX)."""

    offset: int
    views: list[memoryview]
    addrs: list[int]
    nbytes: int


class _Plan:
    """How one request is carried out: parts to submit, bounce copies, write fix-ups."""

    __slots__ = ("fd", "parts", "copies", "head", "length", "bounce", "tail", "done")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parts: list[_Part] = []
        self.copies: list[tuple[memoryview, memoryview]] = []  # (bounce slice, caller slice)
        self.head = 0  # bytes of the first part before the request's own offset
        self.length = 0  # the request's own length
        self.bounce: _Bounce | None = None
        # An unaligned end of a write that extends the file: (file position, views) written through
        # the page cache after the direct part, so the file ends exactly there (see _plan).
        self.tail: tuple[int, list[memoryview]] | None = None
        self.done: list[int] = []  # bytes transferred per part (or -errno)

    def release(self) -> None:
        for b, u in self.copies:
            b.release()
            u.release()
        self.copies = []
        for p in self.parts:
            for v in p.views:
                v.release()
        if self.bounce is not None:
            self.bounce.release()
            self.bounce = None


def _split_parts(plan: _Plan, start: int, views: list[memoryview], addrs: list[int]) -> None:
    pos = start
    for i in range(0, len(views), IOV_MAX):
        vs, ads = views[i:i + IOV_MAX], addrs[i:i + IOV_MAX]
        n = sum(v.nbytes for v in vs)
        plan.parts.append(_Part(pos, vs, ads, n))
        pos += n


def _plan(req: IoRequest, write: bool, direct: bool,
          alloc: Callable[[int], _Bounce | None]) -> _Plan | None:
    """Turn a request into parts. Returns None when ``alloc`` has no bounce memory right now."""
    plan = _Plan(req.fd)
    bufs = [byte_view(b) for b in req.buffers]
    bufs = [b for b in bufs if b.nbytes]
    if not write and any(b.readonly for b in bufs):
        raise TypeError("cannot read into a read-only buffer")
    plan.length = sum(b.nbytes for b in bufs)
    if not plan.length:
        return plan
    if not direct:
        _split_parts(plan, req.offset, bufs, [buffer_address(b) for b in bufs])
        return plan
    end = req.offset + plan.length
    if write and end % ALIGN and end > os.fstat(req.fd).st_size:
        # A direct write would extend the file to a block boundary (and trimming it back races with
        # other writers), so the bytes of the last partial block go through the page cache instead.
        cut = max(0, align_down(end) - req.offset)
        bufs, tail = _split_views(bufs, cut)
        plan.tail = (req.offset + cut, tail)
        if not bufs:
            return plan

    # Pieces in file order: (file position, caller view, address or -1 when it must bounce).
    pieces: list[tuple[int, memoryview, int]] = []
    pos = req.offset
    for b in bufs:
        n = b.nbytes
        addr = buffer_address(b)
        lo, hi = align_up(pos), align_down(pos + n)
        if (addr - pos) % ALIGN == 0 and hi > lo:
            if lo > pos:
                pieces.append((pos, b[:lo - pos], -1))
            pieces.append((lo, b[lo - pos:hi - pos], addr + (lo - pos)))
            if pos + n > hi:
                pieces.append((hi, b[hi - pos:], -1))
        else:
            pieces.append((pos, b, -1))
        pos += n
    end = pos

    # Runs: direct pieces as they are; adjacent bounce pieces merged over whole blocks.
    runs: list[list] = []  # ["d", pos, view, addr] | ["b", lo, hi, [(pos, view), ...]]
    for p, v, a in pieces:
        if a >= 0:
            runs.append(["d", p, v, a])
            continue
        lo, hi = align_down(p), align_up(p + v.nbytes)
        if runs and runs[-1][0] == "b" and runs[-1][2] >= lo:
            runs[-1][2] = max(runs[-1][2], hi)
            runs[-1][3].append((p, v))
        else:
            runs.append(["b", lo, hi, [(p, v)]])

    bounce_bytes = sum(r[2] - r[1] for r in runs if r[0] == "b")
    bounce = None
    if bounce_bytes:
        bounce = alloc(bounce_bytes)
        if bounce is None:
            for r in runs:
                if r[0] == "d":
                    r[2].release()
            return None
    plan.bounce = bounce
    try:
        _lay_out(plan, req, runs, end, write)
    except BaseException:
        plan.release()  # gives the bounce memory back
        raise
    return plan


def _lay_out(plan: _Plan, req: IoRequest, runs: list[list], end: int, write: bool) -> None:
    """Second half of _plan: iovecs and copies over the bounce memory, edge reads for writes."""
    bounce = plan.bounce
    file_start = align_down(req.offset)
    plan.head = req.offset - file_start
    views: list[memoryview] = []
    addrs: list[int] = []
    boff = 0
    for r in runs:
        if r[0] == "d":
            views.append(r[2])
            addrs.append(r[3])
            continue
        _, lo, hi, members = r
        assert bounce is not None
        bv = bounce.view[boff:boff + (hi - lo)]
        for p, v in members:
            plan.copies.append((bv[p - lo:p - lo + v.nbytes], v))
        views.append(bv)
        addrs.append(bounce.addr + boff)
        boff += hi - lo

    if write:
        file_end = align_up(end)
        first, last = views[0], views[-1]
        if plan.head:  # read-modify-write of the first block
            _read_edge(req.fd, file_start, first[:ALIGN])
        if end != file_end:
            _read_edge(req.fd, file_end - ALIGN, last[last.nbytes - ALIGN:])
        for bv, v in plan.copies:
            bv[:] = v
    _split_parts(plan, file_start, views, addrs)


def _split_views(views: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of a scatter list, and the rest."""
    head: list[memoryview] = []
    for k, v in enumerate(views):
        if n >= v.nbytes:
            head.append(v)
            n -= v.nbytes
            continue
        if n:
            head.append(v[:n])
        return head, [v[n:]] + views[k + 1:]
    return head, []


def _write_tail(fd: int, offset: int, views: list[memoryview]) -> int:
    """Buffered write through a second descriptor of the same file (no O_DIRECT); 0 or -errno."""
    try:
        bfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
    except OSError as e:
        return -(e.errno or errno.EIO)
    try:
        part = _Part(offset, views, [], sum(v.nbytes for v in views))
        got = _run_part_sync(bfd, part, True)
        return got if got < 0 else 0
    finally:
        os.close(bfd)


def _read_edge(fd: int, offset: int, block: memoryview) -> None:
    """Fill one aligned block from the file (zeros past EOF) before a partial-block write."""
    n = os.preadv(fd, [block], offset)
    if n < block.nbytes:
        block[n:] = bytes(block.nbytes - n)


def _finish(plan: _Plan, write: bool) -> int:
    """Combine per-part results into the request's result; copy bounce data out after a read."""
    total = 0
    for part, got in zip(plan.parts, plan.done):
        if got < 0:
            if total == 0 or write:
                return got
            break
        total += got
        if got < part.nbytes:
            break
    full = sum(p.nbytes for p in plan.parts)
    if write:
        if total < full:
            return -errno.EIO
        if plan.tail is not None:
            err = _write_tail(plan.fd, *plan.tail)
            if err < 0:
                return err
        return plan.length
    got = max(0, min(plan.length, total - plan.head))
    if plan.copies:
        # Bounce pieces are copied out whole; bytes past ``got`` are garbage the caller ignores.
        for bv, v in plan.copies:
            v[:] = bv
    return got


def _run_part_sync(fd: int, part: _Part, write: bool, done: int = 0) -> int:
    """Carry out (the rest of) one part with preadv/pwritev, looping over short transfers."""
    views = part.views
    while done < part.nbytes:
        skip, idx = done, 0
        while skip >= views[idx].nbytes:
            skip -= views[idx].nbytes
            idx += 1
        rest = [views[idx][skip:]] + list(views[idx + 1:])
        try:
            n = (os.pwritev if write else os.preadv)(fd, rest, part.offset + done)
        except InterruptedError:
            continue
        except OSError as e:
            if done and not write:
                return done
            return -(e.errno or errno.EIO)
        finally:
            rest[0].release()
        if n == 0:
            if write:
                return -errno.ENOSPC
            break
        done += n
    return done


def _execute_sync(req: IoRequest, write: bool, alloc: Callable[[int], _Bounce | None]) -> int:
    """Run one request in the calling thread with preadv/pwritev (POSIX engine, ring fallback)."""
    try:
        direct = is_direct(req.fd)
        plan = _plan(req, write, direct, alloc) or _plan(req, write, direct, _temp_bounce)
    except OSError as e:
        return -(e.errno or errno.EIO)
    assert plan is not None
    try:
        for part in plan.parts:
            got = _run_part_sync(req.fd, part, write)
            plan.done.append(got)
            if got < part.nbytes:
                break
        return _finish(plan, write)
    finally:
        plan.release()


# -- io_uring through raw syscalls -----------------------------------------------------------------

_NR_SETUP, _NR_ENTER, _NR_REGISTER = 425, 426, 427  # same in the generic and x86-64 tables

_OP_READV, _OP_WRITEV, _OP_FSYNC, _OP_READ_FIXED, _OP_WRITE_FIXED = 1, 2, 3, 4, 5
_OP_READ, _OP_WRITE = 22, 23
_FSYNC_DATASYNC = 1
_ENTER_GETEVENTS = 1
_REGISTER_BUFFERS = 0
_FEAT_SINGLE_MMAP = 1
_SETUP_COOP_TASKRUN = 1 << 8
_SETUP_SINGLE_ISSUER = 1 << 12
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000

_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
assert _SQE.size == 64 and _CQE.size == 16


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")] + [
        ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in
                ("sq_entries", "cq_entries", "flags", "sq_thread_cpu", "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def _sys(nr: int, *args: int | ctypes._SimpleCData | object) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _map_ring(fd: int, nbytes: int, offset: int) -> int:
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of io_uring ring failed: {os.strerror(err)}")
    return addr


class _Ring:
    """One io_uring instance, its mapped rings and its registered staging area. One thread only."""

    def __init__(self, entries: int, staging_bytes: int) -> None:
        self.fd = -1
        self._maps: list[tuple[int, int]] = []
        p = _Params()
        p.flags = _SETUP_COOP_TASKRUN | _SETUP_SINGLE_ISSUER
        try:
            self.fd = _sys(_NR_SETUP, ctypes.c_long(entries), ctypes.byref(p))
        except OSError as e:
            if e.errno != errno.EINVAL:  # older kernels reject the flags
                raise
            p = _Params()
            self.fd = _sys(_NR_SETUP, ctypes.c_long(entries), ctypes.byref(p))
        try:
            self._map(p)
        except BaseException:
            self.close()
            raise
        self.entries = p.sq_entries
        self.staging = _Staging(staging_bytes)
        iov = _Iovec(self.staging.addr, self.staging.nbytes)
        try:
            _sys(_NR_REGISTER, ctypes.c_long(self.fd), ctypes.c_long(_REGISTER_BUFFERS), ctypes.byref(iov),
                 ctypes.c_long(1))
            self.staging.fixed = True
        except OSError as e:  # RLIMIT_MEMLOCK for unprivileged users on older kernels
            logger.info("io_uring fixed buffers unavailable (%s); staging used with plain reads", e)
        self._sqe_buf = (ctypes.c_char * (self.entries * 64)).from_address(self._sqes)
        self._cqe_buf = (ctypes.c_char * (p.cq_off.cqes + p.cq_entries * 16)).from_address(self._cq)
        self._cqes_off = p.cq_off.cqes
        self.inflight: dict[int, tuple] = {}  # user_data -> token, for pushed and not yet reaped entries
        self.unsubmitted = 0  # pushed to the submission ring, not yet taken by the kernel
        self.enter_calls = 0  # io_uring_enter syscalls made (batching shows as far fewer than entries)
        self.entries_pushed = 0
        self._next_id = 1

    def _map(self, p: _Params) -> None:
        sq_bytes = p.sq_off.array + p.sq_entries * 4
        cq_bytes = p.cq_off.cqes + p.cq_entries * _CQE.size
        if p.features & _FEAT_SINGLE_MMAP:
            sq_bytes = cq_bytes = max(sq_bytes, cq_bytes)
        self._sq = _map_ring(self.fd, sq_bytes, _OFF_SQ_RING)
        self._maps.append((self._sq, sq_bytes))
        if p.features & _FEAT_SINGLE_MMAP:
            self._cq = self._sq
        else:
            self._cq = _map_ring(self.fd, cq_bytes, _OFF_CQ_RING)
            self._maps.append((self._cq, cq_bytes))
        self._sqes = _map_ring(self.fd, p.sq_entries * _SQE.size, _OFF_SQES)
        self._maps.append((self._sqes, p.sq_entries * _SQE.size))
        u32 = ctypes.c_uint32
        self._sq_tail = u32.from_address(self._sq + p.sq_off.tail)
        self._sq_mask = u32.from_address(self._sq + p.sq_off.ring_mask).value
        self._cq_head = u32.from_address(self._cq + p.cq_off.head)
        self._cq_tail = u32.from_address(self._cq + p.cq_off.tail)
        self._cq_mask = u32.from_address(self._cq + p.cq_off.ring_mask).value
        array = (u32 * p.sq_entries).from_address(self._sq + p.sq_off.array)
        for i in range(p.sq_entries):
            array[i] = i  # SQE slot i always sits at array index i

    def push(self, opcode: int, fd: int, offset: int, addr: int, length: int, rw_flags: int,
             buf_index: int, token: tuple) -> None:
        tail = self._sq_tail.value
        uid = self._next_id
        self._next_id += 1
        _SQE.pack_into(self._sqe_buf, (tail & self._sq_mask) * 64, opcode, 0, 0, fd, offset, addr, length,
                       rw_flags, uid, buf_index, 0, 0, 0, 0)
        self._sq_tail.value = (tail + 1) & 0xFFFFFFFF
        self.inflight[uid] = token
        self.unsubmitted += 1
        self.entries_pushed += 1

    def enter(self, wait: int) -> None:
        """Submit every pushed entry and wait for ``wait`` completions (the kernel may take fewer
        entries when it is short of resources; the rest go with the next call)."""
        flags = _ENTER_GETEVENTS if wait else 0
        while True:
            self.enter_calls += 1
            try:
                self.unsubmitted -= _sys(_NR_ENTER, ctypes.c_long(self.fd), ctypes.c_long(self.unsubmitted),
                                         ctypes.c_long(wait), ctypes.c_long(flags), None, ctypes.c_long(0))
                return
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EBUSY):
                    return
                raise

    def reap(self) -> list[tuple[tuple, int]]:
        head, tail = self._cq_head.value, self._cq_tail.value
        out = []
        while head != tail:
            uid, res, _ = _CQE.unpack_from(self._cqe_buf, self._cqes_off + (head & self._cq_mask) * 16)
            out.append((self.inflight.pop(uid), res))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head
        return out

    def close(self) -> None:
        for addr, n in self._maps:
            _libc.munmap(addr, n)
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)  # also unregisters the fixed buffers
            self.fd = -1
        st = getattr(self, "staging", None)
        if st is not None:
            st.close()


def io_uring_available() -> tuple[bool, str]:
    """Whether this process may use io_uring, and why not when it may not."""
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            if f.read().strip() == "2":
                return False, "disabled by kernel.io_uring_disabled=2"
    except OSError:
        pass
    p = _Params()
    try:
        fd = _sys(_NR_SETUP, ctypes.c_long(2), ctypes.byref(p))
    except OSError as e:
        return False, f"io_uring_setup failed: {e}"
    os.close(fd)
    return True, "ok"


class IoUringEngine:
    """io_uring engine: a private ring per calling thread, up to ``queue_depth`` requests (and
    about ``max_inflight_bytes``) in flight. Completion callbacks run after the next requests have
    been submitted, so their work overlaps the I/O."""

    name = "io_uring"

    def __init__(self, queue_depth: int = 32, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES) -> None:
        self.queue_depth = max(1, queue_depth)
        self.staging_bytes = staging_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self._ring_failures = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._rings: list[tuple[weakref.ref[threading.Thread], _Ring]] = []
        self._closed = False

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is not None:
            return ring
        with self._lock:
            if self._closed:
                raise RuntimeError("io engine is closed")
            alive = []
            for tref, r in self._rings:  # rings of threads that have ended
                t = tref()
                if t is None or not t.is_alive():
                    r.close()
                else:
                    alive.append((tref, r))
            ring = _Ring(self.queue_depth, self.staging_bytes)
            alive.append((weakref.ref(threading.current_thread()), ring))
            self._rings = alive
        self._local.ring = ring
        return ring

    def _ring_or_none(self) -> _Ring | None:
        """This thread's ring, or None when the kernel will not give it one (the calls of this
        thread then run synchronously with preadv/pwritev)."""
        try:
            return self._ring()
        except OSError as e:
            if not self._ring_failures:
                logger.warning("cannot set up an io_uring in thread %s (%s); its I/O runs synchronously",
                               threading.current_thread().name, e)
            self._ring_failures += 1
            return None

    def counters(self) -> dict[str, int]:
        """Totals over the live rings: ``rings``, ``enter_calls`` (syscalls), ``entries`` (SQEs)."""
        with self._lock:
            rings = [r for _, r in self._rings]
        return {"rings": len(rings), "enter_calls": sum(r.enter_calls for r in rings),
                "entries": sum(r.entries_pushed for r in rings)}

    def read(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, False, on_complete)

    def write(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, True, on_complete)

    def _run(self, requests: Sequence[IoRequest], write: bool, on_complete: Completion | None) -> list[int]:
        n = len(requests)
        results = [0] * n
        if not n:
            return results
        ring = self._ring_or_none()
        if ring is None:
            for i, req in enumerate(requests):
                results[i] = _execute_sync(req, write, _temp_bounce)
                if on_complete is not None:
                    on_complete(i, results[i])
            return results
        staging = ring.staging
        plans: dict[int, _Plan] = {}  # planned, not finished
        parts_left: dict[int, int] = {}
        queue: deque[tuple[int, int]] = deque()  # (request, part) ready to submit
        ready: list[int] = []  # finished requests whose callbacks are due
        nxt = inflight = pending_bytes = 0

        def plan_more() -> None:
            nonlocal nxt, pending_bytes
            while nxt < n and len(queue) + inflight < ring.entries and (
                    pending_bytes < self.max_inflight_bytes or not plans):
                req = requests[nxt]
                try:
                    direct = is_direct(req.fd)
                    plan = _plan(req, write, direct, staging.alloc)
                    if plan is None and not plans:
                        plan = _plan(req, write, direct, _temp_bounce)
                except OSError as e:
                    results[nxt] = -(e.errno or errno.EIO)
                    ready.append(nxt)
                    nxt += 1
                    continue
                if plan is None:
                    return  # staging is full: completions will give some back
                plan.done = [0] * len(plan.parts)
                if plan.parts:
                    plans[nxt] = plan
                    parts_left[nxt] = len(plan.parts)
                    pending_bytes += plan.length
                    queue.extend((nxt, j) for j in range(len(plan.parts)))
                else:
                    try:
                        results[nxt] = _finish(plan, write)
                    finally:
                        plan.release()
                    ready.append(nxt)
                nxt += 1

        try:
            while True:
                plan_more()
                while queue and inflight < ring.entries:
                    i, j = queue.popleft()
                    self._push(ring, requests[i].fd, plans[i], j, write, (i, j))
                    inflight += 1
                if ring.unsubmitted:
                    ring.enter(0)
                # Callbacks (checksums, say) run while the kernel works on what was just submitted.
                if on_complete is not None:
                    for i in ready:
                        on_complete(i, results[i])
                ready.clear()
                if not plans and nxt >= n:
                    break
                ring.enter(1)
                for (i, j, *_), res in ring.reap():
                    inflight -= 1
                    plan = plans[i]
                    part = plan.parts[j]
                    if res == -errno.EAGAIN or res == -errno.EINTR:
                        res = _run_part_sync(requests[i].fd, part, write)
                    elif 0 <= res < part.nbytes:  # short transfer: finish it synchronously
                        res = _run_part_sync(requests[i].fd, part, write, res)
                    plan.done[j] = res
                    parts_left[i] -= 1
                    if not parts_left[i]:
                        del parts_left[i], plans[i]
                        pending_bytes -= plan.length
                        try:
                            results[i] = _finish(plan, write)
                        finally:
                            plan.release()
                        ready.append(i)
        except BaseException:
            self._drain(ring)  # the kernel may still write into bounce memory and caller buffers
            for plan in plans.values():
                plan.release()
            raise
        return results

    @staticmethod
    def _drain(ring: _Ring) -> None:
        """Wait out every operation still in the kernel (their buffers must not be freed under it)."""
        while ring.inflight:
            try:
                ring.enter(1)
            except OSError:
                pass
            ring.reap()

    @staticmethod
    def _push(ring: _Ring, fd: int, plan: _Plan, j: int, write: bool, token: tuple) -> None:
        part = plan.parts[j]
        b = plan.bounce
        if len(part.views) == 1:
            addr = part.addrs[0]
            if b is not None and b.fixed and b.addr <= addr < b.addr + b.view.nbytes:
                op = _OP_WRITE_FIXED if write else _OP_READ_FIXED
                ring.push(op, fd, part.offset, addr, part.nbytes, 0, 0, token)
            else:
                ring.push(_OP_WRITE if write else _OP_READ, fd, part.offset, addr, part.nbytes, 0, 0, token)
            return
        iov = (_Iovec * len(part.views))()
        for k, (v, a) in enumerate(zip(part.views, part.addrs)):
            iov[k].base = a
            iov[k].len = v.nbytes
        # The iovec array must outlive the operation: the token keeps it referenced until reaped.
        ring.push(_OP_WRITEV if write else _OP_READV, fd, part.offset, ctypes.addressof(iov), len(part.views), 0,
                  0, token + (iov,))

    def sync(self, fds: Sequence[int], *, datasync: bool = True) -> list[int]:
        results = [0] * len(fds)
        if not fds:
            return results
        ring = self._ring_or_none()
        if ring is None:
            return PosixEngine.sync_inline(fds, datasync)
        i = inflight = 0
        try:
            while i < len(fds) or inflight:
                while i < len(fds) and inflight < ring.entries:
                    ring.push(_OP_FSYNC, fds[i], 0, 0, 0, _FSYNC_DATASYNC if datasync else 0, 0, (i,))
                    i += 1
                    inflight += 1
                ring.enter(1)
                for (k, *_), res in ring.reap():
                    results[k] = res
                    inflight -= 1
        except BaseException:
            self._drain(ring)
            raise
        return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rings, self._rings = self._rings, []
        for _, r in rings:
            r.close()
        self._local = threading.local()


# -- POSIX fallback --------------------------------------------------------------------------------

class PosixEngine:
    """preadv/pwritev on a bounded pool of ``threads`` workers (started on first use)."""

    name = "posix"

    def __init__(self, threads: int = 2, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.threads = max(1, threads)
        self.staging_bytes = staging_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stagings: list[_Staging] = []
        self._closed = False

    def _alloc(self, nbytes: int) -> _Bounce | None:
        st = getattr(self._local, "staging", None)
        if st is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("io engine is closed")
                st = _Staging(self.staging_bytes)
                self._stagings.append(st)
            self._local.staging = st
        return st.alloc(nbytes)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("io engine is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-posix-io")
            return self._pool

    def read(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, False, on_complete)

    def write(self, requests: Sequence[IoRequest], on_complete: Completion | None = None) -> list[int]:
        return self._run(requests, True, on_complete)

    def _run(self, requests: Sequence[IoRequest], write: bool, on_complete: Completion | None) -> list[int]:
        results = [0] * len(requests)
        if len(requests) == 1 or self.threads == 1:
            for i, req in enumerate(requests):
                results[i] = _execute_sync(req, write, self._alloc)
                if on_complete is not None:
                    on_complete(i, results[i])
            return results
        pool = self._executor()
        futures = {pool.submit(_execute_sync, req, write, self._alloc): i for i, req in enumerate(requests)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_complete is not None:
                on_complete(i, results[i])
        return results

    @staticmethod
    def _sync_one(fd: int, datasync: bool) -> int:
        try:
            (os.fdatasync if datasync else os.fsync)(fd)
            return 0
        except OSError as e:
            return -(e.errno or errno.EIO)

    @staticmethod
    def sync_inline(fds: Sequence[int], datasync: bool = True) -> list[int]:
        """fdatasync/fsync each fd in the calling thread; 0 or -errno per fd."""
        return [PosixEngine._sync_one(fd, datasync) for fd in fds]

    def sync(self, fds: Sequence[int], *, datasync: bool = True) -> list[int]:
        if len(fds) <= 1 or self.threads == 1:
            return self.sync_inline(fds, datasync)
        return list(self._executor().map(lambda fd: self._sync_one(fd, datasync), fds))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            stagings, self._stagings = self._stagings, []
        if pool is not None:
            pool.shutdown(wait=True)
        for st in stagings:
            st.close()


def make_io_engine(kind: str = "auto", *, queue_depth: int = 32, threads: int = 2,
                   staging_bytes: int = DEFAULT_STAGING_BYTES) -> IoEngine:
    """An engine by config name: ``"auto"`` and ``"io_uring"`` use io_uring where this process may
    (falling back to POSIX, with a log line, where it may not), ``"posix"`` always uses POSIX."""
    if kind not in ("auto", "io_uring", "posix"):
        raise ValueError(f"io_engine must be auto, io_uring or posix, got {kind!r}")
    if kind != "posix":
        ok, why = io_uring_available()
        if ok:
            return IoUringEngine(queue_depth=queue_depth, staging_bytes=staging_bytes)
        log = logger.warning if kind == "io_uring" else logger.info
        log("io_uring unavailable (%s); using POSIX preadv/pwritev with %d threads", why, threads)
    return PosixEngine(threads=threads, staging_bytes=staging_bytes)
