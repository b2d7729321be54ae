"""The I/O engine seam: the :class:`IoEngine` Protocol and its ``Completion`` callback type.

Implemented by :class:`~store_backend.ssd.io.uring_engine.IoUringEngine` and
:class:`~store_backend.ssd.io.posix_engine.PosixEngine`; built by
:func:`~store_backend.ssd.io.factory.make_io_engine`. The SSD backends hold one and call it from
any thread (the store's offload/promotion workers, readers on the get path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from store_backend.ssd.io.requests import IoRequest

# on_complete(request_index, result): called in the submitting thread as each request finishes.
Completion = Callable[[int, int], None]


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

    def close(self, timeout_s: float | None = None) -> int:
        """Release rings, staging memory and threads. Idempotent; no call may be in flight.
        Blocks at most ``timeout_s`` (None: the engine's own bound) for threads of its own still
        in I/O; returns how many were left running (logged by name; their memory stays theirs)."""
        ...
