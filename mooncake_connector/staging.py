"""Host staging buffers for chunk objects, bounded in bytes and reused.

Engine connectors gather KV into a staging buffer (the canonical chunk layout) before the store
copies it into its DRAM arena, and the store copies loaded objects into a staging buffer before the
connector scatters them into the engine's cache. Buffers are flat uint8 tensors; when the engine's
cache is on a GPU they are allocated pinned, so device copies can run asynchronously.

Thread-safe: acquired on the engine's forward thread, released from the client's I/O threads.
``try_acquire`` never blocks; ``acquire`` waits (bounded) for a release, which is how a connector
applies backpressure instead of dropping a save or failing a load when staging is busy.
An allocation the host refuses (pinned memory is a scarce, locked resource) is not an error either:
``acquire`` answers None, as for a full pool, and the pool shrinks to what it could allocate.

:func:`recommended_staging_bytes` sizes the pool from one chunk's bytes and the engine's batch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict

import torch

logger = logging.getLogger(__name__)


class StagingPool:
    """At most ``capacity_bytes`` of staging memory; freed buffers are kept for reuse."""

    def __init__(self, capacity_bytes: int, *, pin_memory: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._allocated_bytes = 0  # in use plus free-listed
        self._in_use_bytes = 0

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return self._in_use_bytes

    def try_acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of exactly ``nbytes`` (uninitialised), or None when the pool is exhausted.
        Never blocks. The caller returns it with ``release`` when no copy uses it any more."""
        return self.acquire(nbytes, timeout_s=0.0)

    def acquire(self, nbytes: int, timeout_s: float) -> torch.Tensor | None:
        """Like ``try_acquire``, but waits up to ``timeout_s`` for other holders to release enough
        room (None if they did not). A request larger than the whole pool fails at once. When the
        host refuses the allocation (out of memory, pinned memory unavailable) the answer is None
        too, and the pool's capacity drops to the bytes it holds, so later calls wait for those
        instead of asking the host again."""
        if nbytes > self.capacity_bytes:
            return None
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                buf = self._take_locked(nbytes)
                if buf is not None:
                    return buf
                if self._allocated_bytes + nbytes <= self.capacity_bytes:
                    self._allocated_bytes += nbytes
                    self._in_use_bytes += nbytes
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._released.wait(left)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as e:  # torch.OutOfMemoryError is one; so is pinning without a device
            with self._lock:
                self._allocated_bytes -= nbytes
                self._in_use_bytes -= nbytes
                old, self.capacity_bytes = self.capacity_bytes, self._allocated_bytes
                self._released.notify_all()
            logger.warning("staging: allocating %d %sbytes failed (%s); the pool stays at %d of %d bytes",
                           nbytes, "pinned " if self.pin_memory else "", e, self.capacity_bytes, old)
            return None

    def _take_locked(self, nbytes: int) -> torch.Tensor | None:
        """A free-listed buffer of ``nbytes`` (counted in use), else None after trading free
        buffers of other sizes for room (sizes change rarely: one per layout)."""
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self._in_use_bytes += nbytes
            return buf
        for size, bufs in list(self._free.items()):
            while bufs and self._allocated_bytes + nbytes > self.capacity_bytes:
                bufs.pop()
                self._allocated_bytes -= size
        return None

    def release(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        with self._lock:
            self._in_use_bytes -= n
            self._free[n].append(buf)
            self._released.notify_all()


def recommended_staging_bytes(chunk_bytes: int, chunk_tokens: int, max_batched_tokens: int) -> int:
    """Staging one engine step should never have to wait for: ``3 * (ceil(max_batched_tokens /
    chunk_tokens) + 1)`` chunks, i.e. the chunks one step's scheduled tokens can complete (plus one
    for a chunk boundary), as much again for the previous step's saves still being written, and
    one step's worth of loads."""
    per_step = math.ceil(max_batched_tokens / chunk_tokens) + 1
    return 3 * per_step * chunk_bytes
