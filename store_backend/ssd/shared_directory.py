"""An SSD directory shared by several engine processes of one node (file-per-key records).

Each embedded store indexes its SSD directory when it opens it, so objects another process writes
later are invisible to it. :class:`SharedDirectoryBackend` wraps this process's file-per-key
backend and also serves those objects: a key missing from the index is looked up at the path the
key hashes to, and its record is read and checksum-verified like any other. This is what lets a
disaggregated decode instance load what a prefill instance saved a moment ago, through the store.

The directory is held with a shared lock (see :mod:`store_backend.ownership`): every process
opening it through this class may use it at once, and a store that would own it alone (any plain
``ssd`` section on the same path) is refused, as this class is while such a store holds it.

Every write still goes through this process's own backend (atomic rename into place), so a reader
never sees a partial record; an object another process evicted reads as NOT_FOUND (the connector
then recomputes). Opening a directory removes temporary files left by crashed writers, so start
the engines before traffic flows, not while one of them is writing.

Thread-safe (the wrapped backend is; the extra reads hold no state).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

from store_backend.config import ConfigError, SsdConfig
from store_backend.ssd.base import SsdStats
from store_backend.ssd.factory import open_ssd_backend
from store_backend.ssd.file_per_key import FilePerKeyBackend
from store_backend.ssd.io.factory import make_io_engine
from store_backend.ssd.record import HEADER_BLOCK, RecordRead, decode_header, read_records
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_key


class SharedDirectoryBackend:
    """The SsdBackend Protocol over a file-per-key directory that other processes also write."""

    name = "file-shared"
    # Other processes change this directory too: this process hears of its own backend's evictions
    # only (an object another process evicted is found missing: a miss, never other bytes).
    exclusive = False

    def __init__(self, cfg: SsdConfig) -> None:
        if cfg.backend != "file":
            raise ConfigError(f"shared_ssd: needs ssd.backend 'file' (one file per object), got {cfg.backend!r}")
        # A shared lock: every process of the pair may open the directory, a store that wants it
        # alone may not (and while one holds it alone, this open is refused).
        inner = open_ssd_backend(cfg, shared=True)
        assert isinstance(inner, FilePerKeyBackend)
        self._inner = inner
        try:
            self._engine = make_io_engine("posix", threads=1)
        except BaseException:
            inner.close()
            raise

    def path_for(self, key: str) -> str:
        """The record file of ``key`` in the shared directory (whichever process writes it)."""
        return self._inner.path_for(key)

    # -- objects written by other processes --------------------------------------------------------
    def _foreign_header(self, key: str) -> tuple[str, int, int] | None:
        """(path, value_len, seq) of ``key``'s record on disk, if another process wrote one."""
        if check_key(key) is not None:
            return None
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            header = decode_header(os.pread(fd, HEADER_BLOCK, 0))
        finally:
            os.close(fd)
        if header is None or header.key != key.encode():
            return None
        return path, header.value_len, header.seq

    def contains(self, keys: Sequence[str]) -> list[bool]:
        out = self._inner.contains(keys)
        return [hit or self._foreign_header(k) is not None for k, hit in zip(keys, out)]

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        out = self._inner.size_of(keys)
        for i, size in enumerate(out):
            if size is None and (found := self._foreign_header(keys[i])) is not None:
                out[i] = found[1]
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        out = self._inner.get_into(keys, buffers)
        for i, res in enumerate(out):
            if res.status is Status.NOT_FOUND:
                out[i] = self._read_foreign(keys[i], buffers[i])
        return out

    def _read_foreign(self, key: str, buffer: Buffer) -> ReadResult:
        found = self._foreign_header(key)
        if found is None:
            return ReadResult(Status.NOT_FOUND)
        path, value_len, seq = found
        dest = byte_view(buffer)
        if dest.nbytes < value_len:
            return ReadResult(Status.BUFFER_TOO_SMALL)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted by its writer since the header was read
            return ReadResult(Status.NOT_FOUND)
        try:
            (st,) = read_records(self._engine, [RecordRead(fd, 0, key.encode(), value_len, seq, dest)])
        finally:
            os.close(fd)
        return ReadResult(st, value_len if st is Status.OK else 0)

    # -- everything else is this process's backend -------------------------------------------------
    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        # The store asks ``contains`` first, so an object another process wrote answers EXISTS
        # there; a concurrent identical write replaces the file atomically with the same bytes.
        return self._inner.put(keys, buffers)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        return self._inner.remove(keys)

    def keys(self) -> Iterator[str]:
        return self._inner.keys()

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None:
        """This process's backend reports its own evictions (see ``SsdBackend``)."""
        self._inner.set_eviction_listener(fn)

    def stats(self) -> SsdStats:
        return self._inner.stats()

    def close(self) -> None:
        self._inner.close()
        self._engine.close()
