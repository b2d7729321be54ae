"""Request planning: how one :class:`IoRequest` becomes syscalls, and how it runs synchronously.

A request is one contiguous file range read into (or written from) a list of buffers in file
order (scatter/gather). On a file opened with ``O_DIRECT`` the plan handles any alignment
transparently: the block-aligned part of a buffer whose address is congruent to its file position
goes straight to the device; head and tail pieces, and buffers that are not congruent at all, go
through aligned bounce memory (the thread's staging area, registered with the ring as a fixed
buffer, or a temporary mapping for a request larger than the staging area), copied after a read
or before a write. A write whose file range does not start or end on a block boundary reads the
edge blocks first (read-modify-write; two concurrent unaligned writes sharing a block therefore
race, as on any block device), except that the last partial block of a write that extends the file
goes through the page cache (a second descriptor of the same file), so the file ends exactly at
the end of the write. Parts carry at most ``IOV_MAX`` iovecs each.

Who calls it: :mod:`.uring_engine` (plans, then submits the parts to its ring) and
:mod:`.posix_engine` (``execute_sync`` on its pool threads); also the ring engine's synchronous
fallback. A :class:`Staging` area belongs to one thread; plans and the functions here are used by
the thread that made them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable
from typing import NamedTuple

from store_backend.ssd.io.requests import (
    ALIGN,
    IoRequest,
    align_down,
    align_up,
    buffer_address,
    is_direct,
)
from store_backend.types import byte_view

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # Linux UIO_MAXIOV: most iovecs one preadv/pwritev/READV may carry
DEFAULT_STAGING_BYTES = 4 << 20  # per thread; larger bounces use a temporary mapping


class Bounce:
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


class Staging:
    """Per-thread aligned staging area with a tiny first-fit allocator (block granularity)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(max(nbytes, ALIGN))
        self._map = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._map)
        self.addr = buffer_address(self.view)
        self._free: list[list[int]] = [[0, self.nbytes]]  # sorted [offset, length]
        self.fixed = False

    def alloc(self, nbytes: int) -> Bounce | None:
        nbytes = align_up(nbytes)
        for i, ext in enumerate(self._free):
            if ext[1] >= nbytes:
                off = ext[0]
                if ext[1] == nbytes:
                    del self._free[i]
                else:
                    ext[0] += nbytes
                    ext[1] -= nbytes
                return Bounce(self.view[off:off + nbytes], self.addr + off, self.fixed,
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


def temp_bounce(nbytes: int) -> Bounce:
    """Bounce memory in a temporary mapping of its own (unmapped on release), for when staging is short."""
    m = mmap.mmap(-1, align_up(max(nbytes, ALIGN)))
    view = memoryview(m)
    return Bounce(view, buffer_address(view), False, m.close)


class Part(NamedTuple):
    """One syscall's worth of a plan: a contiguous file range and its iovecs (≤ IOV_MAX)."""

    offset: int
    views: list[memoryview]
    addrs: list[int]
    nbytes: int


class Plan:
    """How one request is carried out: parts to submit, bounce copies, write fix-ups."""

    __slots__ = ("fd", "parts", "copies", "head", "length", "bounce", "tail", "done")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parts: list[Part] = []
        self.copies: list[tuple[memoryview, memoryview]] = []  # (bounce slice, caller slice)
        self.head = 0  # bytes of the first part before the request's own offset
        self.length = 0  # the request's own length
        self.bounce: Bounce | None = None
        # An unaligned end of a write that extends the file: (file position, views) written through
        # the page cache after the direct part, so the file ends exactly there (see plan_request).
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


def _split_parts(plan: Plan, start: int, views: list[memoryview], addrs: list[int]) -> None:
    pos = start
    for i in range(0, len(views), IOV_MAX):
        vs, ads = views[i:i + IOV_MAX], addrs[i:i + IOV_MAX]
        n = sum(v.nbytes for v in vs)
        plan.parts.append(Part(pos, vs, ads, n))
        pos += n


def plan_request(req: IoRequest, write: bool, direct: bool,
          alloc: Callable[[int], Bounce | None]) -> Plan | None:
    """Turn a request into parts. Returns None when ``alloc`` has no bounce memory right now."""
    plan = Plan(req.fd)
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


def _lay_out(plan: Plan, req: IoRequest, runs: list[list], end: int, write: bool) -> None:
    """Second half of plan_request: iovecs and copies over the bounce memory, edge reads for writes."""
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
        part = Part(offset, views, [], sum(v.nbytes for v in views))
        got = run_part_sync(bfd, part, True)
        return got if got < 0 else 0
    finally:
        os.close(bfd)


def _read_edge(fd: int, offset: int, block: memoryview) -> None:
    """Fill one aligned block from the file (zeros past EOF) before a partial-block write."""
    n = os.preadv(fd, [block], offset)
    if n < block.nbytes:
        block[n:] = bytes(block.nbytes - n)


def finish_plan(plan: Plan, write: bool) -> int:
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


def run_part_sync(fd: int, part: Part, write: bool, done: int = 0) -> int:
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


def execute_sync(req: IoRequest, write: bool, alloc: Callable[[int], Bounce | None]) -> int:
    """Run one request in the calling thread with preadv/pwritev (POSIX engine, ring fallback)."""
    try:
        direct = is_direct(req.fd)
        plan = plan_request(req, write, direct, alloc) or plan_request(req, write, direct, temp_bounce)
    except OSError as e:
        return -(e.errno or errno.EIO)
    assert plan is not None
    try:
        for part in plan.parts:
            got = run_part_sync(req.fd, part, write)
            plan.done.append(got)
            if got < part.nbytes:
                break
        return finish_plan(plan, write)
    finally:
        plan.release()
