"""This process's mappings of node-service segments: one per segment id, whatever the number of
clients and connections using it (:data:`MAPPINGS`).

A :class:`~store_backend.node.client.NodeClient` connection acquires the mapping of the segment
whose fd came with its ``welcome`` (checked against ``welcome.segment_id`` by
:func:`store_backend.node.segment.map_segment`, mapped ``MAP_SHARED|MAP_POPULATE``) and releases it
when it ends. A mapping nobody uses any more is unmapped, unless a slot view a caller still holds
exports it (``BufferError``): it is kept aside then and unmapped at a later acquire or release, once
those views are gone. After a fork the child starts with an empty table (what it inherited belongs
to its parent's connections).

Thread-safe; acquire blocks on mmap (populating the segment's pages) outside the table's lock.
"""

from __future__ import annotations

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

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._by_id = {}
            self._retired = []

    def acquire(self, fd: int, segment_id: str, nbytes: int) -> SegmentMapping:
        """The mapping of the segment open at ``fd`` (consumed: closed here either way). OSError
        (:class:`~store_backend.node.segment.SegmentMismatchError`) when ``fd`` is not the file
        ``segment_id`` names or is smaller than ``nbytes``, or when it cannot be mapped."""
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
        with self._lock:
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


MAPPINGS = Mappings()
