"""Key fingerprints and chained chunk hashes (engine-agnostic)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_connector.keys import ModelFingerprint, chunk_hashes

FP = ModelFingerprint(model_id="m", kv_dtype="float32", num_layers=2, num_kv_heads=1, head_size=64)


def test_digest_without_weights_or_epoch_is_the_one_stores_were_written_under() -> None:
    # Digests computed before `weights` and `epoch` existed (stores on disk, SGLang's keys).
    assert FP.digest() == "9d9f065024a19cd298ca567448586a2a"
    other = msgspec.structs.replace(FP, shard_index=1, shard_count=2, revision="r", is_mla=True)
    assert other.digest() == "0bb2d4588242cca29d9599ac8d2ac6b0"


def test_weights_and_epoch_enter_the_digest() -> None:
    digests = {FP.digest(), msgspec.structs.replace(FP, epoch=1).digest(),
               msgspec.structs.replace(FP, epoch=2).digest(), msgspec.structs.replace(FP, weights="w1").digest(),
               msgspec.structs.replace(FP, weights="w2").digest()}
    assert len(digests) == 5
    with pytest.raises(ValueError, match="epoch"):
        msgspec.structs.replace(FP, epoch=-1)


def test_chunk_extra_keys_enter_only_their_chunk_and_the_chain_after_it() -> None:
    tokens = list(range(4 * 8))
    plain = chunk_hashes(tokens, 8)
    per = chunk_hashes(tokens, 8, chunk_extra_keys=[None, [], ["mm:x:3"], None])
    assert per[:2] == plain[:2]
    assert per[2] != plain[2] and per[3] != plain[3]
    # Request-wide keys come first, per-chunk ones on top.
    both = chunk_hashes(tokens, 8, extra_keys=["salt:s"], chunk_extra_keys=[None, None, ["mm:x:3"], None])
    salted = chunk_hashes(tokens, 8, extra_keys=["salt:s"])
    assert both[:2] == salted[:2] and both[2] != salted[2] and both[2] != per[2]
    # Extending a chain in two calls gives the one-call hashes.
    first = chunk_hashes(tokens[:16], 8, chunk_extra_keys=[None, []])
    rest = chunk_hashes(tokens[16:], 8, parent=first[-1], chunk_extra_keys=[["mm:x:3"], None])
    assert first + rest == per
    with pytest.raises(ValueError, match="chunk_extra_keys"):
        chunk_hashes(tokens, 8, chunk_extra_keys=[None])


def test_sglang_scheme_keys_every_chunks_own_extra_keys() -> None:
    tokens = [7] * 32  # two 16-token chunks
    plain = chunk_hashes(tokens, 16, scheme="sglang")
    img_a = chunk_hashes(tokens, 16, scheme="sglang", chunk_extra_keys=[[], ["mm:IMAGE_A:0"]])
    img_b = chunk_hashes(tokens, 16, scheme="sglang", chunk_extra_keys=[[], ["mm:IMAGE_B:0"]])
    assert img_a[0] == img_b[0] == plain[0]  # a text-only first chunk keys as SGLang's page
    assert len({img_a[1], img_b[1], plain[1]}) == 3  # the image of the second chunk counts
    e1 = chunk_hashes([0] * 32, 16, scheme="sglang", chunk_extra_keys=[["embeds:111"], ["embeds:222"]])
    e2 = chunk_hashes([0] * 32, 16, scheme="sglang", chunk_extra_keys=[["embeds:111"], ["embeds:333"]])
    assert e1[0] == e2[0] and e1[1] != e2[1]
    # Extending a chain in two calls gives the one-call hashes.
    rest = chunk_hashes(tokens[16:], 16, scheme="sglang", parent=img_a[0], chunk_extra_keys=[["mm:IMAGE_A:0"]])
    assert rest == img_a[1:]


def test_sglang_scheme_plain_pages_are_sglangs_hashes() -> None:
    import hashlib

    tokens = list(range(3, 35))
    first = hashlib.sha256(np.asarray(tokens[:16], dtype="<u4").tobytes()).hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + np.asarray(tokens[16:], dtype="<u4").tobytes()).hexdigest()
    assert chunk_hashes(tokens, 16, scheme="sglang") == [first, second]
    assert chunk_hashes(tokens, 16, scheme="sglang", chunk_extra_keys=[[], []]) == [first, second]


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**40), max_size=700), chunk_tokens=st.integers(1, 64),
       extra=st.none() | st.lists(st.text(max_size=4), max_size=2), parent=st.none() | st.text("0123456789abcdef", max_size=32),
       as_array=st.booleans())
def test_default_scheme_fast_path_hashes_what_the_per_chunk_chain_hashes(
        tokens: list[int], chunk_tokens: int, extra: list[str] | None, parent: str | None, as_array: bool) -> None:
    """The default scheme hashes a whole prompt from one conversion; a call with per-chunk keys (all
    None) goes chunk by chunk through the registered chain function. Both give the same hashes, for a
    list or an int64 array, a trailing partial chunk, extra keys and a parent."""
    given_tokens = np.asarray(tokens, dtype=np.int64) if as_array else tokens
    n = len(tokens) // chunk_tokens
    fast = chunk_hashes(given_tokens, chunk_tokens, extra_keys=extra, parent=parent)
    chained = chunk_hashes(given_tokens, chunk_tokens, extra_keys=extra, parent=parent, chunk_extra_keys=[None] * n)
    assert fast == chained and len(fast) == n


def test_chunk_hashes_are_the_documented_chain_and_do_not_change() -> None:
    """Each chunk's hash is xxh3-128 over its parent's hash text (a zero byte for the first), the
    chunk's token ids as little-endian int64 and the extra-key bytes: computed here independently,
    and pinned, since every store written so far is keyed by it."""
    import xxhash

    tokens = list(range(1000, 1048))
    want, prev = [], b"\x00"
    for i in range(3):
        h = xxhash.xxh3_128(prev)
        h.update(np.asarray(tokens[i * 16:(i + 1) * 16], dtype="<i8").tobytes())
        want.append(h.hexdigest())
        prev = want[-1].encode()
    got = chunk_hashes(tokens, 16)
    assert got == want == chunk_hashes(np.asarray(tokens, dtype=np.int32), 16)
    assert got[0] == "5d33867ff132488e33e7e043f9b2270e"
