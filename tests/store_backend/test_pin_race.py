"""``TieredStore.pin`` answers a key present only when it pinned it (or a lower tier holds it):
a DRAM-only object evicted between the presence check and the pin is answered absent, so the
scheduler never reports a chunk as a hit that nothing protects until the worker's load."""

from __future__ import annotations

import numpy as np

from store_backend.store import TieredStore
from store_backend.types import Status

OBJ = 64 * 1024


def test_a_dram_only_object_removed_before_the_pin_is_answered_absent() -> None:
    with TieredStore({"dram": {"capacity_bytes": 16 * OBJ}}) as store:
        assert store.put(["k0", "k1"], [np.zeros(OBJ, np.uint8)] * 2) == [Status.OK, Status.OK]
        real = store.contains

        def contains_then_evicted(keys: list[str]) -> list[bool]:
            # Fault injection: the object goes (another caller's put evicts it) right after the check.
            out = real(keys)
            assert store.remove(["k1"]) == [Status.OK]
            return out

        store.contains = contains_then_evicted  # type: ignore[method-assign]
        assert store.pin(["k0", "k1"], ttl_s=5) == [True, False]
        store.contains = real  # type: ignore[method-assign]
        assert store.contains(["k0", "k1"]) == [True, False]
