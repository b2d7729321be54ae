"""The index's state (pure): media per source and block, prefix matches, clears."""

from __future__ import annotations

from mooncake_kv.index.state import IndexState
from store_backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def stored(hashes, medium):  # noqa: ANN001, ANN201
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium=medium, lora_name=None)


def removed(hashes, medium):  # noqa: ANN001, ANN201
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def _state() -> IndexState:
    s = IndexState()
    s.apply("e1", KVEventBatch(ts=0, events=[stored([1, 2, 3], "GPU"), stored([1, 2, 3, 4], "CPU")]))
    s.apply("n1", KVEventBatch(ts=0, events=[stored([1, 2], "STORAGE"), stored([1], "CPU")]))
    return s


def test_matches_are_prefixes_split_by_the_fastest_medium() -> None:
    s = _state()
    got = s.match([1, 2, 3, 4, 5])
    assert {k: (m.matched, m.by_medium) for k, m in got.items()} == {
        "e1": (4, {"GPU": 3, "CPU": 1}), "n1": (2, {"CPU": 1, "STORAGE": 1})}
    assert s.match([9, 1]) == {}  # a prefix: the first block missing ends it
    assert {k: m.matched for k, m in s.match([1, 3]).items()} == {"e1": 2, "n1": 1}


def test_removal_takes_one_medium_and_a_clear_one_source() -> None:
    s = _state()
    s.apply("e1", KVEventBatch(ts=0, events=[removed([2], "GPU")]))
    assert s.holders(2) == {"e1": {"CPU"}, "n1": {"STORAGE"}}
    s.apply("e1", KVEventBatch(ts=0, events=[AllBlocksCleared()]))  # vLLM's prefix cache reset: GPU only
    assert s.counts()["e1"] == {"CPU": 4}
    s.clear("n1")
    assert s.holders(1) == {"e1": {"CPU"}} and "n1" not in {k for k, v in s.counts().items() if v}
    s.apply("e1", KVEventBatch(ts=0, events=[removed([1, 2, 3, 4], "CPU"), removed([77], "CPU")]))
    assert s.match([1]) == {} and s.counts()["e1"] == {}


def test_a_repeated_store_and_a_missing_removal_are_harmless() -> None:
    s = IndexState()
    s.apply("a", KVEventBatch(ts=0, events=[stored([b"k"], "CPU"), stored([b"k"], "CPU"), removed([b"x"], "CPU")]))
    assert s.blocks_of("a", "CPU") == {b"k"} and s.events_applied == 3
