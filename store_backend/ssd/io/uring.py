"""io_uring through raw syscalls: one :class:`Ring` (setup, SQ/CQ mmap, push, enter, reap).

liburing is not used (the PyPI package dies with SIGILL on CPUs without AVX-512, and the Debian
library is not on a fresh machine): ``io_uring_setup``, ``io_uring_enter`` and
``io_uring_register`` are called through ``ctypes``, the rings are mapped here and the submission
entries (READ/WRITE, READV/WRITEV, READ_FIXED/WRITE_FIXED, FSYNC) are filled by hand. The ring
protocol's memory ordering is satisfied on x86-64 by the total store order plus the syscall that
precedes every read of the completion ring.

Who calls it: :class:`~store_backend.ssd.io.uring_engine.IoUringEngine`, which gives every calling
thread its own ring (a ring is used by one thread only), and
:func:`~store_backend.ssd.io.factory.make_io_engine` through :func:`io_uring_available` (any thread).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct

from store_backend.ssd.io.planning import Staging

logger = logging.getLogger(__name__)

_NR_SETUP, _NR_ENTER, _NR_REGISTER = 425, 426, 427  # same in the generic and x86-64 tables

OP_READV, OP_WRITEV, OP_FSYNC, OP_READ_FIXED, OP_WRITE_FIXED = 1, 2, 3, 4, 5
OP_READ, OP_WRITE = 22, 23
FSYNC_DATASYNC = 1
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


class Iovec(ctypes.Structure):
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


class Ring:
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
        self.staging = Staging(staging_bytes)
        iov = Iovec(self.staging.addr, self.staging.nbytes)
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
