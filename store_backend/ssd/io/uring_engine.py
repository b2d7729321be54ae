"""The io_uring engine: :class:`IoUringEngine`, a private :class:`~.uring.Ring` per calling thread.

Who calls it: the SSD backends (the store's offload/promotion workers and readers on the get path,
any thread) and :mod:`mooncake_kv.bench.raw_direct`, through the :class:`~.base.IoEngine` Protocol;
built by :func:`~.factory.make_io_engine`. Thread-safe: each thread submits to and reaps from its
own ring; a thread the kernel refuses a ring runs its calls synchronously (:mod:`.planning`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import threading
import weakref
from collections import deque
from collections.abc import Sequence

from store_backend.ssd.io.base import Completion
from store_backend.ssd.io.planning import (
    DEFAULT_STAGING_BYTES,
    Plan,
    execute_sync,
    finish_plan,
    plan_request,
    run_part_sync,
    temp_bounce,
)
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.requests import IoRequest, is_direct
from store_backend.ssd.io.uring import (
    FSYNC_DATASYNC,
    OP_FSYNC,
    OP_READ,
    OP_READ_FIXED,
    OP_READV,
    OP_WRITE,
    OP_WRITE_FIXED,
    OP_WRITEV,
    Iovec,
    Ring,
)

logger = logging.getLogger(__name__)

# Bytes of requests in flight per ring, on top of the queue depth. A few tens of MiB keep a disk
# busy; beyond that, large requests would all finish together and their completion work (checksums)
# could no longer overlap the I/O of the next ones.
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20


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
        self._rings: list[tuple[weakref.ref[threading.Thread], Ring]] = []
        self._closed = False

    def _ring(self) -> Ring:
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
            ring = Ring(self.queue_depth, self.staging_bytes)
            alive.append((weakref.ref(threading.current_thread()), ring))
            self._rings = alive
        self._local.ring = ring
        return ring

    def _ring_or_none(self) -> Ring | None:
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
                results[i] = execute_sync(req, write, temp_bounce)
                if on_complete is not None:
                    on_complete(i, results[i])
            return results
        staging = ring.staging
        plans: dict[int, Plan] = {}  # planned, not finished
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
                    plan = plan_request(req, write, direct, staging.alloc)
                    if plan is None and not plans:
                        plan = plan_request(req, write, direct, temp_bounce)
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
                        results[nxt] = finish_plan(plan, write)
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
                        res = run_part_sync(requests[i].fd, part, write)
                    elif 0 <= res < part.nbytes:  # short transfer: finish it synchronously
                        res = run_part_sync(requests[i].fd, part, write, res)
                    plan.done[j] = res
                    parts_left[i] -= 1
                    if not parts_left[i]:
                        del parts_left[i], plans[i]
                        pending_bytes -= plan.length
                        try:
                            results[i] = finish_plan(plan, write)
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
    def _drain(ring: Ring) -> None:
        """Wait out every operation still in the kernel (their buffers must not be freed under it)."""
        while ring.inflight:
            try:
                ring.enter(1)
            except OSError:
                pass
            ring.reap()

    @staticmethod
    def _push(ring: Ring, fd: int, plan: Plan, j: int, write: bool, token: tuple) -> None:
        part = plan.parts[j]
        b = plan.bounce
        if len(part.views) == 1:
            addr = part.addrs[0]
            if b is not None and b.fixed and b.addr <= addr < b.addr + b.view.nbytes:
                op = OP_WRITE_FIXED if write else OP_READ_FIXED
                ring.push(op, fd, part.offset, addr, part.nbytes, 0, 0, token)
            else:
                ring.push(OP_WRITE if write else OP_READ, fd, part.offset, addr, part.nbytes, 0, 0, token)
            return
        iov = (Iovec * len(part.views))()
        for k, (v, a) in enumerate(zip(part.views, part.addrs)):
            iov[k].base = a
            iov[k].len = v.nbytes
        # The iovec array must outlive the operation: the token keeps it referenced until reaped.
        ring.push(OP_WRITEV if write else OP_READV, fd, part.offset, ctypes.addressof(iov), len(part.views), 0,
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
                    ring.push(OP_FSYNC, fds[i], 0, 0, 0, FSYNC_DATASYNC if datasync else 0, 0, (i,))
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

    def close(self, timeout_s: float | None = None) -> int:
        """Release the rings (no thread of its own: ``timeout_s`` has nothing to bound); 0 threads
        left running."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            rings, self._rings = self._rings, []
        for _, r in rings:
            r.close()
        self._local = threading.local()
        return 0
