"""Residency events to KV events (pure): media, runs, removals from every tier, listings."""

from __future__ import annotations

import pytest

from store_backend.events.config import EventsConfig
from store_backend.events.translate import listing_events, translate
from store_backend.events.wire import BlockRemoved, BlockStored
from store_backend.residency import ResidencyEvent as R


def _shape(events):  # noqa: ANN001, ANN202
    return [(type(e).__name__, e.medium, [h.decode() for h in e.block_hashes]) for e in events]


@pytest.mark.parametrize("residency, want", [
    ([R("stored", "a", "dram", 1), R("stored", "b", "dram", 1)], [("BlockStored", "CPU", ["a", "b"])]),
    ([R("moved", "a", "ssd", 1, "dram")], [("BlockStored", "STORAGE", ["a"])]),
    ([R("moved", "a", "dram", 1, "ssd")], [("BlockStored", "CPU", ["a"])]),  # a promotion
    ([R("evicted", "a", "dram", 1)], [("BlockRemoved", "CPU", ["a"])]),
    ([R("evicted", "a", "ssd", 1, lost=True)], [("BlockRemoved", "STORAGE", ["a"])]),
    ([R("removed", "a", "*", 0), R("removed", "b", "*", 0)],
     [("BlockRemoved", "CPU", ["a", "b"]), ("BlockRemoved", "STORAGE", ["a", "b"])]),
    ([R("stored", "a", "dram", 1), R("evicted", "a", "dram", 1), R("stored", "a", "dram", 1)],
     [("BlockStored", "CPU", ["a"]), ("BlockRemoved", "CPU", ["a"]), ("BlockStored", "CPU", ["a"])]),
    ([R("stored", "a", "pool", 1), R("evicted", "b", "pool", 1)], []),  # another node announces its own
    ([], []),
])
def test_translation(residency, want) -> None:  # noqa: ANN001
    assert _shape(translate(residency, "n")) == want


def test_order_is_kept_across_kinds_and_media() -> None:
    evs = translate([R("stored", "a", "dram", 1), R("moved", "a", "ssd", 1, "dram"), R("evicted", "a", "dram", 1),
                     R("removed", "a", "*", 0)], "n")
    assert [type(e) for e in evs] == [BlockStored, BlockStored, BlockRemoved, BlockRemoved, BlockRemoved]


def test_listing_events_batch_each_tier_and_skip_unknown_tiers() -> None:
    got = listing_events({"dram": ["a", "b", "c"], "ssd": ["a"], "pool": ["z"]}, "n", batch_keys=2)
    assert _shape(got) == [("BlockStored", "CPU", ["a", "b"]), ("BlockStored", "CPU", ["c"]),
                           ("BlockStored", "STORAGE", ["a"])]
    assert all(e.ownership == "n" for e in got)


@pytest.mark.parametrize("fields, message", [
    ({"endpoint": "localhost:5557"}, "endpoint: 'localhost:5557' is not a ZMQ endpoint"),
    ({"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}, "replay_endpoint: must differ"),
    ({"buffer_batches": 0}, r"buffer_batches: must be in \[1, 2147483647\]"),
    ({"hwm": 2**31}, r"hwm: must be in \[1, 2147483647\], got 2147483648"),
    ({"backend_id": ""}, "backend_id: must not be empty"),
])
def test_bad_events_config_is_refused_naming_the_field(fields, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        EventsConfig(**fields)
