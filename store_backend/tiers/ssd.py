"""The SSD tier: any :class:`~store_backend.ssd.base.SsdBackend` as a :class:`~store_backend.tiers.base.Tier`.

A thin adapter owned by the store: the backend does the work (and is thread-safe); this class
names the tier ("ssd"), states its traits and turns the backend's ``SsdStats`` into the tier's
gauges and extra counters. A backend that says ``exclusive = False`` (the shared directory that
several processes write) is taken at its word; one without ``set_eviction_listener`` (a test's
dict-backed fake) is one that never evicts on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from store_backend.ssd.base import SsdBackend
from store_backend.tiers.base import TierGauges, TierTraits
from store_backend.types import Buffer, ReadResult, Status


class SsdTier:
    """The Tier Protocol over one SSD backend (which it owns from construction: ``close`` closes it)."""

    name = "ssd"

    def __init__(self, backend: SsdBackend) -> None:
        self.backend = backend
        self.traits = TierTraits(backs_dram=True, durable=True,
                                 exclusive=bool(getattr(backend, "exclusive", True)), local_index=True)

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        return self.backend.put(keys, buffers)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        return self.backend.get_into(keys, buffers)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.contains(keys)

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        return self.backend.size_of(keys)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        return self.backend.remove(keys)

    def keys(self) -> Iterator[str]:
        return self.backend.keys()

    def gauges(self) -> TierGauges:
        st = self.backend.stats()
        return TierGauges(objects=st.objects, used_bytes=st.used_bytes, capacity_bytes=st.capacity_bytes,
                          evictions=st.evictions)

    def extra_stats(self) -> dict[str, int]:
        """The backend's recovery and integrity counts (``corrupt_reads``, ``recovered_objects``)."""
        st = self.backend.stats()
        return {"corrupt_reads": st.corrupt_reads, "recovered_objects": st.recovered_objects}

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None:
        listen = getattr(self.backend, "set_eviction_listener", None)
        if listen is not None:
            listen(fn)

    def close(self) -> None:
        self.backend.close()
