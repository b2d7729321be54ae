"""vLLM's KV-event wire format, defined here so the store needs no engine.

The same classes, field order, defaults and msgspec options as vLLM 0.32's
``vllm/distributed/kv_events.py``, so what :func:`encode_batch` makes is byte for byte what vLLM's
``msgspec.msgpack.Encoder().encode(KVEventBatch(...))`` makes for the same events (a test compares
them): a batch is a positional array ``[ts, events]`` (``data_parallel_rank`` only when set); each
event a map whose first key ``"type"`` names its class (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), fields at their defaults left out.

A message on the PUB socket is three frames: the topic, the batch's sequence number (8 bytes,
big-endian, unsigned) and the encoded batch. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

# The hash of one block: vLLM's are 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)
# or raw bytes; the store's are its object keys as UTF-8 bytes.
ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name under ``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)

# The sequence frame of the replay socket's last reply to a request (vLLM's END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch as vLLM encodes it."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its bytes (vLLM's or ours); msgspec.DecodeError names what is malformed."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A sequence frame's number; -1 for :data:`END_SEQ`. ValueError for a frame not 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)
