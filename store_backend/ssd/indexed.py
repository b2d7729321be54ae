"""Index queries shared by the SSD backends: each keeps ``key -> record location`` in memory.

A backend class derives from :class:`IndexedBackend` and provides ``_lock`` (guarding ``_index``),
``_index`` (values with a ``value_len``), ``_stats`` (an :class:`SsdStats`) and ``_closed``; it
overrides ``_used_bytes_now`` when it does not keep ``_used_bytes``. Thread-safe like the backends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from store_backend.ssd.base import SsdStats
from store_backend.types import check_batch


class IndexedBackend:
    _lock: threading.Lock
    _index: dict[str, Any]
    _stats: SsdStats
    _closed: bool
    _used_bytes: int

    def _used_bytes_now(self) -> int:
        """Bytes on disk (called with ``_lock`` held)."""
        return self._used_bytes

    def contains(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys)
        with self._lock:
            return [isinstance(k, str) and k in self._index for k in keys]

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        check_batch(keys)
        out: list[int | None] = []
        with self._lock:
            for k in keys:
                loc = self._index.get(k) if isinstance(k, str) else None
                out.append(None if loc is None else loc.value_len)
        return out

    def keys(self) -> Iterator[str]:
        """A snapshot of the stored keys (taken now; later changes are not seen)."""
        with self._lock:
            snapshot = list(self._index)
        return iter(snapshot)

    def stats(self) -> SsdStats:
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.objects = len(self._index)
            s.used_bytes = self._used_bytes_now()
            return s

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSD backend is closed")
