"""``host_mapping()``: the one mapping every slot view lies in (what a GPU worker registers with CUDA).

Checked on the embedded store and on a node client: every reservation's and lease's ``offset`` is
inside the mapping, and the mapping's bytes at that offset are the slot's own bytes (written through
the slot, read through the mapping and back), so registering the mapping covers every slot.
"""

from __future__ import annotations

import numpy as np
import pytest

from store_backend.api import StoreClosedError
from store_backend.types import Status
from tests.store_backend.conftest import payload

SIZE = 64 << 10
DRAM = {"dram": {"capacity_bytes": 1 << 20}}


def test_every_slot_lies_in_the_host_mapping_at_its_offset(make_store) -> None:
    s = make_store(DRAM)
    mapping = s.host_mapping()
    assert isinstance(mapping, memoryview) and mapping.nbytes >= 1 << 20
    keys = [f"k{i}" for i in range(8)]
    res = s.reserve(keys, [SIZE] * len(keys))
    assert [r.status for r in res] == [Status.OK] * len(keys)
    offsets = sorted(r.offset for r in res)
    assert len(set(offsets)) == len(keys)
    for r in res:
        assert 0 <= r.offset and r.offset + r.nbytes <= mapping.nbytes
        np.frombuffer(r.view, dtype=np.uint8)[:] = payload(r.key, SIZE)
        # The same bytes, seen through the whole mapping: the slot is that range of it.
        assert bytes(mapping[r.offset:r.offset + r.nbytes]) == payload(r.key, SIZE).tobytes()
    assert s.commit(res) == [Status.OK] * len(keys)
    leases = s.lease(keys)
    assert [ls.status for ls in leases] == [Status.OK] * len(keys)
    for ls in leases:
        assert 0 <= ls.offset and ls.offset + ls.nbytes <= mapping.nbytes
        assert bytes(mapping[ls.offset:ls.offset + ls.nbytes]) == bytes(ls.view) == payload(ls.key, SIZE).tobytes()
    assert s.release(leases) == [True] * len(keys)
    del mapping
    s.close(flush=False, timeout_s=30)
    with pytest.raises(StoreClosedError):
        s.host_mapping()
