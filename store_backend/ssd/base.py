"""The SSD tier's seam: one Protocol that the bucket, offset-allocator and file-per-key backends share.

Called by the store's offload/promotion engine (its worker threads) and by readers on the get path
(any thread). Every implementation is thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from store_backend.types import Buffer, ReadResult, Status


class SsdStats(msgspec.Struct):
    objects: int = 0
    used_bytes: int = 0  # bytes on disk, headers and padding included
    capacity_bytes: int = 0
    evictions: int = 0  # objects dropped by the backend's own eviction
    corrupt_reads: int = 0  # records that failed their checksum (each one served as a miss)
    recovered_objects: int = 0  # objects found on disk when the backend was opened
    discarded_records: int = 0  # partial/torn records dropped during recovery
    unreadable_files: int = 0  # files skipped at open because reading them failed (left in place, logged)


@runtime_checkable
class SsdBackend(Protocol):
    """Durable object storage on one directory.

    Contracts shared by every backend (the contract suite in tests/store_backend checks them):

    - ``put`` blocks until each object it reports OK is durable: after a crash (even SIGKILL right
      after it returns) a backend reopened on the same directory serves it byte-identical. Objects
      are immutable: a key already present answers EXISTS and keeps its bytes.
    - ``get_into`` copies an object into the caller's buffer and verifies its checksum; a torn or
      corrupt record answers CORRUPT (and is dropped from the index), never bytes. The caller owns
      the buffer; the backend does not keep it after the call returns.
    - A record being read is never overwritten under the reader.
    - When full, the backend evicts by its own order to make room: for ``capacity_bytes``, for
      ``disk_watermark`` of the file system, and when a write meets ENOSPC (then it evicts what
      the write needs and writes again, a bounded number of times). An object larger than the
      capacity answers TOO_LARGE; NO_SPACE when no room could be made (a disk full of other files
      is met before a write by evicting nothing). Evicted objects are misses, never other bytes.
    - Opening a backend on a directory that holds data recovers every object reported durable;
      one unreadable file is skipped (``unreadable_files``) and the backend opens.
    - One owner per directory: a second opener is refused (``store_backend.ownership``).
    - Private: the directory is this user's and nobody else writes in it; every file a backend
      makes is 0600 and every directory 0700, whatever the umask (``store_backend.private``).
    - ``set_eviction_listener(fn)``: ``fn(keys)`` is told of every object the backend's own
      eviction drops, once per object, never for ``remove``: synchronously, in the thread of the
      ``put`` that evicted, at the moment the object leaves the backend's index (its lock held),
      so before any reader of the index can miss it and before that ``put`` returns. ``fn`` must
      only do in-memory work that never blocks on I/O and never call back into the backend. The
      store keeps its "this DRAM copy is persisted" flags honest with it, without asking under
      its lock (lock order: backend lock, then store lock; the store calls no tier under its own).
    """

    name: str

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]: ...

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]: ...

    def contains(self, keys: Sequence[str]) -> list[bool]: ...

    def size_of(self, keys: Sequence[str]) -> list[int | None]: ...

    def remove(self, keys: Sequence[str]) -> list[Status]: ...

    def keys(self) -> Iterator[str]: ...

    def stats(self) -> SsdStats: ...

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None: ...

    def close(self) -> None: ...
