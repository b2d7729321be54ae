"""The store's KV-event encoder against vLLM's own: the same events make the same bytes, and each
side decodes the other's (store_backend imports no engine, so it defines the format itself)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm.distributed import kv_events as vk  # noqa: E402

from store_backend.events import wire  # noqa: E402
from store_backend.events.translate import translate  # noqa: E402
from store_backend.residency import ResidencyEvent  # noqa: E402

pytestmark = pytest.mark.vllm

hashes = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=80)), max_size=6)
opt_text = st.none() | st.text(max_size=12)
opt_int = st.none() | st.integers(0, 1 << 20)
media = st.sampled_from([None, wire.MEDIUM_GPU, wire.MEDIUM_CPU, wire.MEDIUM_STORAGE])
extra = st.none() | st.lists(st.none() | st.tuples(st.text(max_size=6), st.integers(0, 99)), max_size=3)


@st.composite
def stored(draw):  # noqa: ANN001, ANN201
    return dict(block_hashes=draw(hashes), parent_block_hash=draw(st.none() | st.integers(0, 2**64 - 1)),
                token_ids=draw(st.lists(st.integers(0, 1 << 20), max_size=8)), block_size=draw(st.integers(0, 1024)),
                lora_id=draw(opt_int), medium=draw(media), lora_name=draw(opt_text), extra_keys=draw(extra),
                group_idx=draw(opt_int), kv_cache_spec_kind=draw(opt_text),
                kv_cache_spec_sliding_window=draw(opt_int), locality=draw(st.sampled_from([None, "LOCAL", "REMOTE"])),
                ownership=draw(opt_text), session_id=draw(opt_text))


@st.composite
def removed(draw):  # noqa: ANN001, ANN201
    return dict(block_hashes=draw(hashes), medium=draw(media), group_idx=draw(opt_int),
                locality=draw(st.sampled_from([None, "LOCAL", "REMOTE"])), ownership=draw(opt_text))


events = st.lists(st.one_of(stored().map(lambda f: ("BlockStored", f)), removed().map(lambda f: ("BlockRemoved", f)),
                            st.just(("AllBlocksCleared", {}))), max_size=8)


def _both(kind: str, fields: dict):  # noqa: ANN202
    return getattr(vk, kind)(**fields), getattr(wire, kind)(**fields)


@settings(max_examples=200, deadline=None)
@given(evs=events, ts=st.floats(0, 2e9, allow_nan=False), dp=st.none() | st.integers(0, 7))
def test_the_same_events_encode_to_the_same_bytes_and_decode_both_ways(evs, ts, dp) -> None:  # noqa: ANN001
    theirs, ours = zip(*(_both(k, f) for k, f in evs)) if evs else ((), ())
    their_bytes = msgspec.msgpack.Encoder().encode(vk.KVEventBatch(ts=ts, events=list(theirs), data_parallel_rank=dp))
    our_bytes = wire.encode_batch(wire.KVEventBatch(ts=ts, events=list(ours), data_parallel_rank=dp))
    assert our_bytes == their_bytes
    back = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(our_bytes)
    assert [type(e).__name__ for e in back.events] == [k for k, _ in evs]
    assert wire.decode_batch(their_bytes) == wire.KVEventBatch(ts=ts, events=list(ours), data_parallel_rank=dp)


def test_what_the_store_publishes_decodes_with_vllms_classes() -> None:
    residency = [ResidencyEvent("stored", "d1/a", "dram", 10), ResidencyEvent("moved", "d1/a", "ssd", 10, "dram"),
                 ResidencyEvent("evicted", "d1/a", "dram", 10), ResidencyEvent("removed", "d1/a", "*", 0)]
    payload = wire.encode_batch(wire.KVEventBatch(ts=1.5, events=translate(residency, "node-a")))
    batch = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(payload)
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in batch.events] == [
        ("BlockStored", "CPU", [b"d1/a"]), ("BlockStored", "STORAGE", [b"d1/a"]), ("BlockRemoved", "CPU", [b"d1/a"]),
        ("BlockRemoved", "CPU", [b"d1/a"]), ("BlockRemoved", "STORAGE", [b"d1/a"])]
    assert {e.ownership for e in batch.events} == {"node-a"} and {e.locality for e in batch.events} == {"LOCAL"}
    assert batch.events[0].token_ids == [] and batch.events[0].block_size == 0


def test_the_sequence_frames_are_vllms() -> None:
    assert wire.END_SEQ == vk.ZmqEventPublisher.END_SEQ
    assert wire.seq_bytes(7) == (7).to_bytes(8, "big") and wire.seq_of(wire.seq_bytes(2**63)) == 2**63
    assert wire.seq_of(wire.END_SEQ) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        wire.seq_of(b"\x00")
