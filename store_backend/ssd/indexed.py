"""Index queries shared by the SSD backends: each keeps ``key -> record location`` in memory.

A backend class derives from :class:`IndexedBackend` and provides ``_lock`` (guarding ``_index``),
``_index`` (values with a ``value_len``), ``_stats`` (an :class:`SsdStats`) and ``_closed``; it
overrides ``_used_bytes_now`` when it does not keep ``_used_bytes``. Thread-safe like the backends.

Eviction reports (``set_eviction_listener``): a backend calls :meth:`_note_evicted` under ``_lock``
for each object its own eviction drops, at the moment it takes the object out of ``_index``; the
listener runs there, synchronously, in the evicting thread with ``_lock`` held, once per evicted
object, and never for ``remove``. So no reader of the index can miss an object before its owner
has heard that it is gone (a DRAM copy that still read "persisted" then could drop the last copy).
The listener therefore must only do in-memory work and never call back into the backend.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from store_backend.ssd.base import SsdStats
from store_backend.types import check_batch

logger = logging.getLogger(__name__)


class IndexedBackend:
    _lock: threading.Lock
    _index: dict[str, Any]
    _stats: SsdStats
    _closed: bool
    _used_bytes: int
    _eviction_listener: Callable[[list[str]], None] | None = None

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None:
        """Call ``fn(keys)`` for the objects this backend's own eviction drops (see the module
        docstring: under ``_lock``, so ``fn`` must not block nor call this backend); None stops
        the reports. Set it before traffic starts."""
        with self._lock:
            self._eviction_listener = fn

    def _note_evicted(self, keys: Iterable[str]) -> None:
        """(``_lock`` held) Tell the listener, now, of objects this thread's eviction takes out of
        ``_index`` (called in the same critical section as the removal). A listener that raises is
        logged; the eviction and the put's own outcome stand."""
        fn = self._eviction_listener
        if fn is None:
            return
        keys = list(keys)
        if keys:
            try:
                fn(keys)
            except Exception:
                logger.exception("eviction listener failed for %d evicted objects", len(keys))

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
