"""The index keys an engine's self-describing events by their token ids (pure, no sockets): a
prompt's query matches the engine's GPU blocks and the connector's chunks whatever hashes the
engine used; removals, vLLM's AllBlocksCleared, LoRA names and unknown parents behave as stated in
``mooncake_kv.index.tokens``."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_kv.index.service import IndexConfig, KVIndex
from mooncake_kv.index.tokens import prompt_keys
from store_backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 16


def _vllm_extra(block: int, lora: str | None, salt: str | None) -> list[str] | None:
    """vLLM 0.32's event extra keys of a text block (written out here from its
    ``generate_block_hash_extra_keys`` and ``to_event_extra_keys``; the connector's test pins them
    to vLLM's own functions): every block the LoRA name, the first block then the cache salt."""
    keys = ([lora] if lora else []) + ([salt] if salt and block == 0 else [])
    return keys or None


def _blocks(prompt: list[int], first: int, n: int, hashes: list[int], medium: str = "GPU",
            lora: str | None = None, salt: str | None = None) -> BlockStored:
    """Blocks ``first``..``first+n-1`` of ``prompt``, as vLLM describes them (its own hashes)."""
    extra = [_vllm_extra(b, lora, salt) for b in range(first, first + n)]
    return BlockStored(block_hashes=hashes[first:first + n], parent_block_hash=hashes[first - 1] if first else None,
                       token_ids=prompt[first * BS:(first + n) * BS], block_size=BS, lora_id=None, medium=medium,
                       lora_name=lora, extra_keys=extra if any(extra) else None)


def _batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def _index() -> KVIndex:
    return KVIndex(IndexConfig(chunk_tokens=4 * BS))


def test_an_engines_blocks_match_a_prompt_by_its_tokens_split_by_medium() -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(10 * BS + 5)]
    hashes = [rng.getrandbits(63) for _ in range(10)]  # the engine's hashes: the index cannot compute them
    index = _index()
    try:
        # Blocks 0-5 on the GPU in two events (the second chained on the first's last block), and
        # the connector's chunk of blocks 4-7 in CPU (the same engine hashes, token ids, parent).
        index.apply("e1", _batch(_blocks(prompt, 0, 3, hashes), _blocks(prompt, 3, 3, hashes),
                                 _blocks(prompt, 4, 4, hashes, "CPU")))
        got = index.query_tokens(prompt).instances["e1"]
        assert (got.matched, got.unit_tokens, got.matched_tokens) == (8, BS, 8 * BS)
        assert got.tokens_by_medium == {"GPU": 6 * BS, "CPU": 2 * BS}
        assert index.query_tokens(prompt).longest_matched_tokens == 8 * BS
        # Another prompt sharing the first 2 blocks only.
        other = prompt[:2 * BS] + [t + 1 for t in prompt[2 * BS:]]
        assert index.query_tokens(other).instances["e1"].matched_tokens == 2 * BS
        # A LoRA adapter's blocks are other blocks.
        assert index.query_tokens(prompt, lora_name="adapter").instances == {}
        # GPU eviction of block 2 ends the match there (blocks 4-7 stay in CPU, after a hole).
        index.apply("e1", _batch(BlockRemoved(block_hashes=[hashes[2]], medium="GPU")))
        assert index.query_tokens(prompt).instances["e1"].matched_tokens == 2 * BS
        # vLLM's prefix-cache reset empties the GPU only: the CPU chunk is held, but its first
        # block (4) is not the prompt's first, so the prompt matches nothing.
        index.apply("e1", _batch(AllBlocksCleared()))
        assert index.query_tokens(prompt).instances == {}
        assert index.query_blocks(hashes[4:8]).instances["e1"].by_medium == {"CPU": 4}
        stats = index.token_key_stats()
        assert stats["block_sizes"] == [BS] and stats["mapped"] == 4  # blocks 0-3 forgotten with their GPU copy
    finally:
        index.close()


def test_an_event_whose_parent_is_unknown_or_undescribed_is_not_keyed() -> None:
    prompt = list(range(4 * BS))
    hashes = [11, 12, 13, 14]
    index = _index()
    try:
        index.apply("e1", _batch(_blocks(prompt, 2, 2, hashes)))  # parent 12 never seen
        bad = BlockStored(block_hashes=[99], parent_block_hash=None, token_ids=[1, 2], block_size=BS, lora_id=None,
                          medium="GPU", lora_name=None)  # 2 token ids for a block of 16
        index.apply("e1", _batch(bad))
        assert index.query_tokens(prompt).instances == {}
        assert index.token_key_stats()["unchained"] == 1 and index.token_key_stats()["undescribed"] == 1
        index.apply("e1", _batch(_blocks(prompt, 0, 2, hashes)))
        assert index.query_tokens(prompt).instances["e1"].matched_tokens == 2 * BS
    finally:
        index.close()


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 2**31), min_size=BS, max_size=6 * BS), cut=st.integers(1, 6),
       lora=st.none() | st.text(min_size=1, max_size=5), salt=st.none() | st.text(min_size=1, max_size=5))
def test_events_cut_anywhere_key_the_blocks_as_the_prompt_does(prompt: list[int], cut: int, lora: str | None,
                                                              salt: str | None) -> None:
    """However an engine splits a prompt's blocks into events, the chained keys are the prompt's,
    under its LoRA name and cache salt only."""
    n = len(prompt) // BS
    hashes = list(range(100, 100 + n))
    index = _index()
    try:
        first = min(cut, n)
        index.apply("e", _batch(_blocks(prompt, 0, first, hashes, lora=lora, salt=salt)))
        if first < n:
            index.apply("e", _batch(_blocks(prompt, first, n - first, hashes, lora=lora, salt=salt)))
        got = index.query_tokens(prompt, lora_name=lora, cache_salt=salt).instances["e"]
        assert got.matched_tokens == n * BS and got.tokens_by_medium == {"GPU": n * BS}
        assert len(prompt_keys(prompt, BS, lora, salt)) == n
        # Another salt (or none where there was one, or one where there was none) matches nothing.
        assert index.query_tokens(prompt, lora_name=lora, cache_salt=(salt or "") + "x").instances == {}
        if salt:
            assert index.query_tokens(prompt, lora_name=lora).instances == {}
    finally:
        index.close()


def test_blocks_of_locality_remote_are_held_as_remote() -> None:
    """A connector's chunk reachable only over the pool (locality REMOTE) is held under REMOTE,
    ranked after the local media; its removal of the same locality takes it away."""
    prompt = list(range(100, 100 + 4 * BS))
    hashes = [1, 2, 3, 4]
    index = _index()
    try:
        remote = msgspec.structs.replace(_blocks(prompt, 2, 2, hashes, "CPU"), locality="REMOTE")
        index.apply("e", _batch(_blocks(prompt, 0, 2, hashes), remote))
        got = index.query_tokens(prompt).instances["e"]
        assert got.tokens_by_medium == {"GPU": 2 * BS, "REMOTE": 2 * BS}
        index.apply("e", _batch(BlockRemoved(block_hashes=hashes[2:], medium="CPU", locality="REMOTE")))
        assert index.query_tokens(prompt).instances["e"].tokens_by_medium == {"GPU": 2 * BS}
    finally:
        index.close()


def test_store_chunks_of_a_salted_prompt_match_its_salt_only() -> None:
    """A node service's events name store objects (``<digest>/<chunk hash>``), hashed by the
    connector with the request's cache salt among the extra keys: a query with the same salt finds
    them, without it or with another it does not. A query naming a LoRA adapter does not look the
    chunk keys up (an adapter's keys carry its files' stamp), so the base model's chunks are not
    credited to it."""
    from mooncake_connector.keys import chunk_hashes, object_key, salt_extra_key

    digest, ct = "d" * 16, 4 * BS
    prompt = list(range(1000, 1000 + 3 * ct))
    index = _index()
    try:
        for extra in ([salt_extra_key("s1")], None):
            keys = [object_key(digest, h).encode() for h in chunk_hashes(prompt[:2 * ct] if extra else prompt, ct,
                                                                           extra_keys=extra)]
            index.apply("node", _batch(BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                                                   block_size=0, lora_id=None, medium="CPU", lora_name=None)))
        assert index.query_tokens(prompt, cache_salt="s1").instances["node"].matched_tokens == 2 * ct
        assert index.query_tokens(prompt).instances["node"].matched_tokens == 3 * ct
        assert index.query_tokens(prompt, cache_salt="s2").instances == {}
        assert index.query_tokens(prompt, lora_name="ad").instances == {}
        # Extra keys given whole are used as given.
        assert index.query_tokens(prompt, extra_keys=[salt_extra_key("s1")]).instances["node"].matched == 2
    finally:
        index.close()
