"""This process's mappings of node-service segments: one per segment id, whatever the number of
clients and connections using it (:data:`MAPPINGS`).

A :class:`~store_backend.node.client.NodeClient` connection acquires the mapping of the segment
whose fd came with its ``welcome`` (checked against ``welcome.segment_id`` by
:func:`store_backend.node.segment.map_segment`, mapped ``MAP_SHARED|MAP_POPULATE``) and releases it
when it ends. A mapping nobody uses any more is unmapped, unless a slot view a caller still holds
exports it (``BufferError``): it is kept aside then and unmapped at a later acquire or release, once
those views are gone.

A forked child never shares the segment with its parent, two ways:

- **The kernel** (``madvise(MADV_DONTFORK)`` on every mapping, before it is used): a child made by
  any ``fork`` (``os.fork``, a C library or extension that forks, ``multiprocessing``'s fork start)
  gets no mapping of the segment at all at those addresses; a write there from C code that skipped
  Python's fork hooks faults (SIGSEGV) instead of landing in a slot the service may since have
  given to another key. ``vfork``/``posix_spawn`` children share the parent's memory until they
  exec, as the parent's own threads would.
- **Python's fork hook** (``os.register_at_fork``, installed at the first mapping): in a child of
  ``os.fork`` the table starts empty (what it inherited belongs to its parent's connections) and
  every segment range the parent had mapped is filled with private anonymous memory at the same
  addresses, so Python objects that still point there (an inherited slot view, the ``mmap`` object
  itself) stay harmless: what the child writes through them lands in its own private pages, what it
  reads there is zeros (and its release of an inherited lease answers False: the child's client
  knows none of its parent's tokens).

The limit: a thread of the *parent* that is still copying when the parent exits is gone with it; a
process that obtained the segment's fd otherwise (``/proc/<pid>/fd`` of a client, as the same user)
can map it anew: same-user processes are trusted (docs/NODE.md, "Access"; ``verify_reads`` catches
the bytes such a process changes).

Thread-safe; acquire blocks on mmap (populating the segment's pages) outside the table's lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

from store_backend.node.fdpass import fd_identity
from store_backend.node.segment import map_segment


class SegmentMapping:
    """This process's mapping of one service segment. ``slot(offset, nbytes)`` is a writable view
    of part of it. Unmapped by :class:`Mappings` once no client uses it."""

    def __init__(self, segment_id: str, mm: mmap.mmap, nbytes: int) -> None:
        self.segment_id = segment_id
        self.nbytes = nbytes
        self._mmap = mm
        self.view = memoryview(mm)
        self.refs = 0
        anchor = ctypes.c_char.from_buffer(mm)  # an export of mm only while this line's object lives
        self.address = ctypes.addressof(anchor)
        del anchor
        self.length = len(mm)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset + nbytes) of the segment; ValueError when they are not inside it
        (a grant that does not fit is a broken service, never written through)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) is outside the {self.nbytes}-byte segment "
                             f"{self.segment_id}")
        return self.view[offset:offset + nbytes]

    def try_close(self) -> bool:
        """Unmap; False while a view exported from it is still alive (BufferError), retried later."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            return False
        return True


class Mappings:
    """The process-wide table of segment mappings, counted by ``acquire``/``retain``/``release``."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._by_id: dict[str, SegmentMapping] = {}
        self._retired: list[SegmentMapping] = []
        self._hooked = False

    def _before_fork(self) -> None:
        """(In the forking thread.) Hold the table still across the fork, so that the child sees
        every mapping the parent has made."""
        self._lock.acquire()

    def _after_fork_in_parent(self) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        """(In a child of ``os.fork``, before anything else runs there.) The kernel left the segment
        ranges unmapped (MADV_DONTFORK): fill them with private anonymous pages at the same
        addresses, so that the inherited Python objects pointing there stay harmless."""
        for m in [*self._by_id.values(), *self._retired]:
            _replace_with_private(m.address, m.length)
        self._pid = -1  # _check_fork makes a fresh (unlocked) table
        self._check_fork()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._by_id = {}
            self._retired = []

    def acquire(self, fd: int, segment_id: str, nbytes: int) -> SegmentMapping:
        """The mapping of the segment open at ``fd`` (consumed: closed here either way), never
        inherited by a forked child (``MADV_DONTFORK``). OSError
        (:class:`~store_backend.node.segment.SegmentMismatchError`) when ``fd`` is not the file
        ``segment_id`` names or is smaller than ``nbytes``, or when it cannot be mapped (or marked
        so)."""
        self._check_fork()
        try:
            with self._lock:
                self._sweep()
                m = self._by_id.get(segment_id)
                if m is not None and fd_identity(fd) == segment_id:
                    m.refs += 1
                    return m
            mm = map_segment(fd, nbytes, segment_id, populate=True)
        finally:
            os.close(fd)
        try:
            # No child of any fork inherits this mapping (a fork from C code skips the hook below).
            mm.madvise(mmap.MADV_DONTFORK)
        except OSError:
            mm.close()
            raise
        with self._lock:
            if not self._hooked:
                os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent,
                                    after_in_child=self._after_fork_in_child)
                self._hooked = True
            m = self._by_id.get(segment_id)
            if m is None:
                m = self._by_id[segment_id] = SegmentMapping(segment_id, mm, nbytes)
            else:  # another thread mapped it meanwhile
                mm.close()
            m.refs += 1
            return m

    def retain(self, m: SegmentMapping) -> SegmentMapping:
        """One more user of a mapping already acquired."""
        with self._lock:
            m.refs += 1
        return m

    def release(self, m: SegmentMapping) -> None:
        self._check_fork()
        with self._lock:
            if self._by_id.get(m.segment_id) is not m:
                return  # inherited from the parent, or already retired
            m.refs -= 1
            if m.refs <= 0:
                del self._by_id[m.segment_id]
                if not m.try_close():
                    self._retired.append(m)
            self._sweep()

    def _sweep(self) -> None:
        self._retired = [m for m in self._retired if not m.try_close()]

    def mapped(self) -> dict[str, int]:
        """Segment id -> users, and ``"retired"``: old mappings still waiting for their views."""
        self._check_fork()
        with self._lock:
            self._sweep()
            out = {k: m.refs for k, m in self._by_id.items()}
            if self._retired:
                out["retired"] = len(self._retired)
            return out


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def _replace_with_private(address: int, length: int) -> None:
    """Map private anonymous memory over ``[address, address + length)`` (MAP_FIXED, reserving no
    swap: the child pays only for pages it touches): nothing of the shared segment is there in this
    process (the kernel left the range unmapped at fork; a shared mapping still there would go).
    Where the kernel refuses a writable range (strict overcommit), the range is mapped with no
    access at all (a stray touch faults). Aborts the process when both fail: a child that could
    still write into the service's slots must not run on."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    got = _libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got == _MAP_FAILED or got != address:
        got = _libc.mmap(address, length, 0, flags, -1, 0)  # PROT_NONE: never charged
    if got == _MAP_FAILED or got != address:
        os.write(2, b"mooncake-kv: cannot detach the node segment in a forked child; aborting it\n")
        os.abort()


MAPPINGS = Mappings()
