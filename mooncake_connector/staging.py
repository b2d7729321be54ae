"""Host staging buffers for chunk objects, bounded in bytes and reused.

Engine connectors gather KV into a staging buffer (the canonical chunk layout) before the store
copies it into its DRAM arena, and the store copies loaded objects into a staging buffer before the
connector scatters them into the engine's cache. Buffers are flat uint8 tensors; when the engine's
cache is on a GPU they are allocated pinned, so device copies can run asynchronously.

Thread-safe: acquired on the engine's forward thread, released from the client's I/O threads.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class StagingPool:
    """At most ``capacity_bytes`` of staging memory; freed buffers are kept for reuse."""

    def __init__(self, capacity_bytes: int, *, pin_memory: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
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
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                self._in_use_bytes += nbytes
                return buf
            if self._allocated_bytes + nbytes > self.capacity_bytes:
                # Trade free buffers of other sizes for room (sizes change rarely: one per layout).
                for size, bufs in list(self._free.items()):
                    while bufs and self._allocated_bytes + nbytes > self.capacity_bytes:
                        bufs.pop()
                        self._allocated_bytes -= size
                if self._allocated_bytes + nbytes > self.capacity_bytes:
                    return None
            self._allocated_bytes += nbytes
            self._in_use_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def release(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        with self._lock:
            self._in_use_bytes -= n
            self._free[n].append(buf)
