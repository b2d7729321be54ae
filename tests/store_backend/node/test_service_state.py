"""Where a lease's result counts a miss in a client process's share of the store's per-tier counts
(``missed_tiers``), for every kind of result."""

from __future__ import annotations

import pytest

from store_backend.node.service_state import missed_tiers
from store_backend.slots import SlotLease
from store_backend.types import Status

ALL = ["dram", "ssd", "pool"]


@pytest.mark.parametrize(("status", "source", "asked", "missed"), [
    (Status.OK, "dram", ALL, []),  # a DRAM hit misses nowhere
    (Status.OK, "ssd", ALL, ["dram"]),  # staged in from SSD: DRAM missed it first
    (Status.OK, "pool", ALL, ["dram", "ssd"]),  # from the pool: both local tiers missed it
    (Status.NOT_FOUND, "dram", ALL, ALL),  # no tier held it
    (Status.NOT_FOUND, "dram", ["dram"], ["dram"]),  # a lease that does not stage in asks DRAM only
    (Status.NOT_FOUND, "ssd", ALL, ["dram", "ssd"]),  # found on SSD, removed before it was read
    (Status.CORRUPT, "ssd", ALL, ["dram", "ssd"]),  # the SSD read failed: SSD missed too, the pool was not asked
    (Status.IO_ERROR, "pool", ALL, ALL),
    (Status.NO_SPACE, "dram", ALL, []),  # in DRAM, over the process's share: no tier missed it
    (Status.NO_SPACE, "ssd", ALL, ["dram"]),  # found on SSD, no room to stage it in
    (Status.TOO_LARGE, "ssd", ALL, ["dram"]),
    (Status.INVALID_KEY, "dram", ALL, []),  # no tier was asked
])
def test_each_result_misses_the_tiers_the_store_counts(status: Status, source: str, asked: list[str],
                                                        missed: list[str]) -> None:
    assert list(missed_tiers(SlotLease(status, "k", source=source), asked)) == missed
