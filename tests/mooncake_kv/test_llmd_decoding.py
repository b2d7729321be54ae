"""Every KV event we publish, read by a consumer written to llm-d's rules for vLLM KV events.

The decoder below is written here from llm-d's documented format and the rules its vLLM adapter
states (no code of theirs is copied, and it uses none of this project's wire classes: payloads are
read with ``msgspec.msgpack.decode`` into plain lists, dicts, ints, bytes and strings). Sources, in
``llm-d/llm-d-kv-cache`` (the KV-cache indexer, formerly ``llm-d-kv-cache-manager``):

- ``docs/architecture.md`` ("Write Path: Ingesting KV-Events", "CPU Offloading", "The Dual-Key
  Design", "Engine Adapter", "Multimodal, LoRA, and Hybrid Attention"): the topic
  ``kv@<pod>@<model>``; ``BlockStored`` carries engine keys plus the token chunk, and the indexer
  computes its own *request keys* from the tokens and records engine key -> request key;
  ``BlockRemoved`` evicts through that mapping (engine keys only); a ``BlockStored`` with engine
  keys and a tier but **no tokens** only adds a tier to request keys already mapped from those
  engine keys, and is a no-op for an engine key it never saw with tokens; a non-empty
  ``lora_name`` replaces the model name in the request keys; ``data_parallel_rank`` is ignored.
- ``pkg/kvevents/engineadapter/vllm_adapter.go`` and ``common.go`` (map support: PR #661, "support
  map-encoded vLLM KV events", merged; llm-d-inference-sim's PR #570 names v0.9.0 as the release
  that has it; v0.8.1 and older read events as positional arrays only): the message is three frames (topic, 8-byte big-endian sequence,
  payload); the batch is a positional array ``[ts, events, data_parallel_rank?]``; an event is a
  positional array ``[tag, ...]`` or a map whose ``"type"`` (a string) is the tag; a map's fields
  are read by name (``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window; ``BlockRemoved``: block_hashes, medium, group_idx), an absent one
  reads as null and any other key is ignored; an unknown tag, a missing or non-string tag, or a
  field of the wrong type fails the whole batch. A hash is an int (taken as an unsigned 64-bit
  value) or bytes, of which only the **last 8 bytes** count (big-endian; shorter ones zero-padded
  on the left; empty bytes rejected); any other type is rejected. A null parent reads as 0 (no
  parent). ``token_ids`` must be an array of ints (empty allowed), ``block_size`` an int,
  ``group_idx`` an int >= 0, ``extra_keys`` null or an array of (null | array).
- ``pkg/kvevents/pool.go``: the device tier is ``medium`` lower-cased, ``"gpu"`` when absent; a
  ``BlockStored`` with a parent resolves the parent's engine key to a request key first and is
  skipped when it cannot; token chunks are cut at the indexer's own block size (not the event's
  ``block_size``); when they give no full block the event takes the tier-only path above.
- ``pkg/kvcache/kvblock/extra_keys.go``: per block, a bare string in ``extra_keys`` or an array
  whose first element is a string is read as a multimodal content hash; other entries are skipped.
- ``docs/configuration.md`` (``kvCacheBackendConfigs``) and ``pkg/kvcache/kvblock_scorer.go``:
  tier weights default to gpu 1.0 and cpu 0.8; a tier not configured weighs 1.0.

What follows from those rules for what we publish (asserted below, each where it shows, with a
comment): every event parses; the node service's ``bytes`` keys are *misread* as their last 8
bytes (the tail of the chunk hash's hex text), so keys that differ only in their fingerprint
(another TP shard, another cache epoch, another model) become one engine key; and since its events
carry no tokens and their engine keys are never seen with tokens, an llm-d indexer indexes nothing
from the node service. ``STORAGE`` is not a configured tier by default and weighs as much as GPU.
Older llm-d (array-only events, v0.8.1 and before) rejects every batch we send, as it rejects
vLLM 0.32's own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm import SamplingParams
from vllm.distributed import kv_events as vk
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from mooncake_connector.keys import ModelFingerprint, chunk_keys
from store_backend.events.translate import listing_events, translate
from store_backend.events.wire import KVEventBatch, encode_batch, seq_bytes
from store_backend.residency import ResidencyEvent
from vllm_plugin.kv_events import ConnectorEvents

pytestmark = pytest.mark.vllm


# == a consumer written to llm-d's rules ==========================================================

class Rejected(ValueError):
    """The rules reject this: an llm-d indexer drops the whole batch (logged as a decode error)."""


U64 = (1 << 64) - 1
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


@dataclass(frozen=True)
class Stored:
    engine_keys: list[int]
    parent: int  # 0: no parent
    tokens: list[int]
    block_size: int
    medium: str | None
    lora_id: int | None
    lora_name: str | None
    mm_hashes: list[list[str]] | None  # per block, what extra_keys yield as multimodal hashes
    group_idx: int | None
    spec_kind: str | None
    sliding_window: int | None


@dataclass(frozen=True)
class Removed:
    engine_keys: list[int]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True)
class Cleared:
    pass


def kind(ev: Stored | Removed | Cleared) -> str:
    """The vLLM tag an event was read from."""
    return {Stored: "BlockStored", Removed: "BlockRemoved", Cleared: "AllBlocksCleared"}[type(ev)]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def engine_key(raw: object) -> int:
    """A block hash as the rules read it: ints as unsigned 64-bit, bytes by their last 8 bytes."""
    if _is_int(raw):
        return raw & U64  # type: ignore[operator]
    if isinstance(raw, bytes):
        if not raw:
            raise Rejected("empty hash bytes")
        return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")
    raise Rejected(f"hash of type {type(raw).__name__}")


def _opt(v: object, ok: Any, what: str) -> Any:
    if v is not None and not ok(v):
        raise Rejected(f"{what}: {v!r}")
    return v


def _mm_hashes(extra: object) -> list[list[str]] | None:
    if extra is None:
        return None
    if not isinstance(extra, list):
        raise Rejected("extra_keys is not an array")
    out = []
    for block in extra:
        if block is not None and not isinstance(block, list):
            raise Rejected("an extra_keys entry is neither null nor an array")
        out.append([e if isinstance(e, str) else e[0] for e in block or ()
                    if isinstance(e, str) or (isinstance(e, list) and e and isinstance(e[0], str))])
    return out


def _fields(raw: object, names: tuple[str, ...], array_only: bool) -> tuple[str, list[Any]]:
    """(tag, the fields in ``names`` order, absent ones None) of an array- or map-encoded event."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise Rejected("array event without a string tag")
        return raw[0], (raw[1:] + [None] * len(names))[:len(names)]
    if isinstance(raw, dict):
        if array_only:
            raise Rejected("map-encoded event (the array-only adapter of llm-d <= v0.8.1)")
        if "type" not in raw or not isinstance(raw["type"], str):
            raise Rejected("map event without a string 'type'")
        return raw["type"], [raw.get(n) for n in names]
    raise Rejected(f"event is a {type(raw).__name__}")


def decode_event(raw: object, *, array_only: bool = False) -> Stored | Removed | Cleared:
    tag = raw[0] if isinstance(raw, list) and raw else raw.get("type") if isinstance(raw, dict) else None
    if tag == "BlockStored":
        _, f = _fields(raw, STORED_FIELDS, array_only)
        if isinstance(raw, list) and len(raw) < 5:
            raise Rejected("BlockStored array shorter than 5")
        hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra, group, kind, window = f
        if not isinstance(hashes, list):
            raise Rejected("block_hashes is not an array")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise Rejected("token_ids is not an array of ints")
        if not _is_int(block_size):
            raise Rejected("block_size is not an int")
        return Stored(engine_keys=[engine_key(h) for h in hashes], parent=0 if parent is None else engine_key(parent),
                      tokens=tokens, block_size=block_size, medium=_opt(medium, lambda v: isinstance(v, str), "medium"),
                      lora_id=_opt(lora_id, _is_int, "lora_id"),
                      lora_name=_opt(lora_name, lambda v: isinstance(v, str), "lora_name"), mm_hashes=_mm_hashes(extra),
                      group_idx=_opt(group, lambda v: _is_int(v) and v >= 0, "group_idx"),
                      spec_kind=_opt(kind, lambda v: isinstance(v, str), "kv_cache_spec_kind"),
                      sliding_window=_opt(window, _is_int, "kv_cache_spec_sliding_window"))
    if tag == "BlockRemoved":
        _, (hashes, medium, group) = _fields(raw, REMOVED_FIELDS, array_only)
        if not isinstance(hashes, list):
            raise Rejected("block_hashes is not an array")
        return Removed(engine_keys=[engine_key(h) for h in hashes],
                       medium=_opt(medium, lambda v: isinstance(v, str), "medium"),
                       group_idx=_opt(group, lambda v: _is_int(v) and v >= 0, "group_idx"))
    if tag == "AllBlocksCleared":
        _fields(raw, (), array_only)
        return Cleared()
    _fields(raw, (), array_only)  # the array-only and tag checks come first
    raise Rejected(f"unknown event tag {tag!r}")


def decode_batch(payload: bytes, *, array_only: bool = False) -> tuple[float, list[Stored | Removed | Cleared]]:
    """(ts, events) of one payload; the data-parallel rank is read and ignored."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise Rejected(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3:
        raise Rejected("the batch is not a positional array [ts, events, dp_rank?]")
    ts, events = batch[0], batch[1]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise Rejected("bad ts or events")
    if len(batch) == 3:
        _opt(batch[2], _is_int, "data_parallel_rank")
    return float(ts), [decode_event(e, array_only=array_only) for e in events]


def decode_message(frames: list[bytes]) -> tuple[str, str, list[Stored | Removed | Cleared]]:
    """(pod, model, events) of one ZMQ message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise Rejected("not (topic, 8-byte sequence, payload)")
    topic = frames[0].decode()
    parts = topic.split("@")
    pod, model = (parts[1], parts[2]) if len(parts) == 3 else (topic, "")
    return pod, model, decode_batch(frames[2])[1]


def device_tier(medium: str | None) -> str:
    return medium.lower() if medium else "gpu"


DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


def tier_weight(tier: str) -> float:
    return DEFAULT_TIER_WEIGHTS.get(tier, 1.0)


@dataclass
class DualKeyIndex:
    """The indexer's two key spaces as docs/architecture.md describes them. Request keys here are
    a stand-in chained hash (llm-d's is FNV-64a over CBOR; only their role matters here), and
    extra features are not folded in."""

    block_size: int = 16  # the indexer's own (canonical) block size
    entries: dict[int, set[tuple[str, str]]] = field(default_factory=dict)  # request key -> {(pod, tier)}
    engine_to_request: dict[int, list[int]] = field(default_factory=dict)

    def request_keys(self, parent: int | None, tokens: list[int], model: str) -> list[int]:
        keys = []
        for i in range(len(tokens) // self.block_size):
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            digest = hashlib.blake2b(repr((parent, chunk, model)).encode(), digest_size=8).digest()
            parent = int.from_bytes(digest, "big")
            keys.append(parent)
        return keys

    def apply(self, pod: str, model: str, events: list[Stored | Removed | Cleared]) -> None:
        for ev in events:
            if isinstance(ev, Cleared):
                for holders in self.entries.values():
                    holders -= {h for h in holders if h[0] == pod}
                continue
            entry = (pod, device_tier(ev.medium))
            if isinstance(ev, Removed):
                for ek in ev.engine_keys:
                    rks = self.engine_to_request.get(ek, [])
                    for rk in rks:
                        self.entries.get(rk, set()).discard(entry)
                    if rks and not any(self.entries.get(rk) for rk in rks):
                        del self.engine_to_request[ek]
                continue
            parent = None
            if ev.parent:
                if ev.parent not in self.engine_to_request:
                    continue  # the parent cannot be resolved: the event is skipped
                parent = self.engine_to_request[ev.parent][-1]
            rks = self.request_keys(parent, ev.tokens, ev.lora_name or model)
            if not rks:  # the tier-only path: known engine keys gain a tier, unknown ones nothing
                if not ev.tokens:
                    for ek in ev.engine_keys:
                        for rk in self.engine_to_request.get(ek, []):
                            self.entries.setdefault(rk, set()).add(entry)
                continue
            n, m = len(ev.engine_keys), len(rks)
            for i, ek in enumerate(ev.engine_keys):  # 1:1, many:1 or 1:many by the ratio
                mine = rks[i * m // n:max(i * m // n + 1, (i + 1) * m // n)]
                self.engine_to_request[ek] = mine
            for rk in rks:
                self.entries.setdefault(rk, set()).add(entry)

    def holders(self) -> set[tuple[str, str]]:
        return set().union(*self.entries.values()) if self.entries else set()


# == what we publish =============================================================================

BLOCK = 16
BPC = 4  # vLLM blocks per connector chunk
CHUNK = BLOCK * BPC
HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)
FP = {"model_id": "m", "kv_dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 64}


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def store_keys(tokens: list[int], **fp: Any) -> list[str]:
    return chunk_keys(ModelFingerprint(**{**FP, **fp}), tokens, CHUNK)


def tail(key: str) -> int:
    """The engine key llm-d's bytes rule makes of a store key: its last 8 bytes, big-endian."""
    return int.from_bytes(key.encode()[-8:], "big")


def node_payloads(keys: list[str], dp_rank: int | None = None) -> tuple[list[bytes], list[tuple]]:
    """The node service's payloads for every kind of residency change and a listing, with what each
    event must read as: (type, engine keys, tokens, medium)."""
    k0, k1 = keys[0], keys[1]
    changes = [ResidencyEvent("stored", k0, "dram", 10), ResidencyEvent("stored", k1, "dram", 10),
               ResidencyEvent("moved", k0, "ssd", 10, "dram"), ResidencyEvent("moved", k0, "dram", 10, "ssd"),
               ResidencyEvent("evicted", k1, "dram", 10), ResidencyEvent("stored", "elsewhere/x", "pool", 10),
               ResidencyEvent("evicted", k0, "ssd", 10), ResidencyEvent("removed", k0, "*", 0)]
    listing = listing_events({"dram": [k0, k1], "ssd": [k0], "pool": ["elsewhere/x"]}, "node-a", batch_keys=1)
    payloads = [encode_batch(KVEventBatch(ts=1.5, events=translate(changes, "node-a"), data_parallel_rank=dp_rank)),
                encode_batch(KVEventBatch(ts=2.5, events=listing))]
    want = [("BlockStored", [k0, k1], "CPU"), ("BlockStored", [k0], "STORAGE"), ("BlockStored", [k0], "CPU"),
            ("BlockRemoved", [k1], "CPU"), ("BlockRemoved", [k0], "STORAGE"), ("BlockRemoved", [k0], "CPU"),
            ("BlockRemoved", [k0], "STORAGE"),
            ("BlockStored", [k0], "CPU"), ("BlockStored", [k1], "CPU"), ("BlockStored", [k0], "STORAGE")]
    return payloads, [(t, [tail(k) for k in ks], [], m) for t, ks, m in want]


def vllm_request(req_id: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, lora_request=lora,
                   block_hasher=get_request_block_hasher(BLOCK, HASH_FN))


def vllm_payload(events: list[Any], dp_rank: int | None = None) -> bytes:
    return msgspec.msgpack.Encoder().encode(vk.KVEventBatch(ts=3.5, events=events, data_parallel_rank=dp_rank))


def u64(h: bytes) -> int:
    """vLLM's block hash as an int (what maybe_convert_block_hash makes of it by default)."""
    return int.from_bytes(h, "big") & U64


def connector_events(req: Request, *, max_announced: int = 1 << 20) -> list[Any]:
    """What vllm_plugin.kv_events.ConnectorEvents emits for ``req``'s first two chunks: both landed,
    then the first removed (a failed load), then a cache reset (the second removed)."""
    ev = ConnectorEvents(BLOCK, BPC, max_announced=max_announced)
    for c in (0, 1):
        ev.planned(req, c, f"c{c}", save_id=c)
    for c in (0, 1):
        ev.landed(c)
    ev.gone(["c0"])
    ev.reset()
    return ev.take()


# == the tests ===================================================================================

def test_node_service_events_parse_and_their_byte_keys_read_as_their_last_8_bytes() -> None:
    keys = store_keys(tokens_of(1, 2 * CHUNK))
    payloads, want = node_payloads(keys, dp_rank=0)
    got = []
    for p in payloads:
        _ts, events = decode_batch(p)
        got += events
    # Every event parses. Its hashes are read under the bytes rule (last 8 bytes, big-endian): the
    # store key "<fingerprint digest>/<chunk hash>" is MISREAD as the tail of its chunk hash's hex
    # text, not as the key (asserted through tail(), which is that rule).
    assert [(kind(e), e.engine_keys, getattr(e, "tokens", []), e.medium) for e in got] == want
    stored = [e for e in got if isinstance(e, Stored)]
    # No tokens, block_size 0, no parent, no LoRA, no group: parsed as given (block_size is not
    # checked against the tokens; only a group's metadata would use it, and there is no group).
    assert {(len(e.tokens), e.block_size, e.parent, e.lora_name, e.group_idx) for e in stored} == {
        (0, 0, 0, None, None)}
    # The tiers llm-d files them under; STORAGE is not a default tier and weighs as GPU does.
    assert {device_tier(e.medium) for e in got} == {"cpu", "storage"}
    assert tier_weight("storage") == tier_weight("gpu") == 1.0 and tier_weight("cpu") == 0.8
    # The message frames: (topic, 8-byte sequence, payload); pod and model come from the topic.
    assert decode_message([b"kv@node-a@m", seq_bytes(7), payloads[0]])[:2] == ("node-a", "m")
    # Our default topic is "" (vLLM's default): llm-d then takes the whole topic as the pod id and
    # no model name, so a deployment must set topic "kv@<pod>@<model>" for llm-d.
    assert decode_message([b"", seq_bytes(7), payloads[0]])[:2] == ("", "")


def test_byte_keys_of_one_chunk_under_other_fingerprints_collapse_to_one_llmd_engine_key() -> None:
    tokens = tokens_of(2, CHUNK)
    keys = store_keys(tokens) + store_keys(tokens, shard_index=1, shard_count=2) + store_keys(tokens, epoch=1) + \
        store_keys(tokens, model_id="other")
    assert len(set(keys)) == 4  # four different objects of the store
    events = translate([ResidencyEvent("stored", k, "dram", 10) for k in keys], "node-a")
    (ev,) = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=events)))[1]
    # MISREAD under llm-d's bytes rule: only the last 8 bytes count, and the fingerprint digest is
    # the key's prefix, so a TP shard, a cache epoch or a model of the same tokens is one engine
    # key; and those 8 bytes are 8 hex characters: 32 bits of the chunk hash, not 64.
    assert len(set(ev.engine_keys)) == 1
    assert ev.engine_keys[0].to_bytes(8, "big") == keys[0].split("/")[1][-8:].encode()


def test_connector_events_parse_with_their_hashes_tokens_and_lora() -> None:
    tokens = tokens_of(3, 2 * CHUNK + 5)
    plain = vllm_request("plain", tokens)
    lora = vllm_request("lora", tokens_of(4, 2 * CHUNK + 5), LoRARequest("ad", 3, "/nonexistent"))
    for req, la in ((plain, None), (lora, LoRARequest("ad", 3, "/nonexistent"))):
        events = connector_events(req)
        raw = msgspec.msgpack.decode(vllm_payload(events, dp_rank=1))
        assert {type(h) for e in raw[1] for h in e["block_hashes"]} == {int}  # the int form is what is sent
        got = decode_batch(vllm_payload(events, dp_rank=1))[1]
        blocks = [u64(h) for h in req.block_hashes]
        chunk_keys_ = [blocks[c * BPC:(c + 1) * BPC] for c in (0, 1)]
        assert [(kind(e), e.engine_keys, getattr(e, "tokens", None), e.medium) for e in got] == [
            ("BlockStored", chunk_keys_[0], req.all_token_ids[:CHUNK], "CPU"),
            ("BlockStored", chunk_keys_[1], req.all_token_ids[CHUNK:2 * CHUNK], "CPU"),
            ("BlockRemoved", chunk_keys_[0], None, "CPU"), ("BlockRemoved", chunk_keys_[1], None, "CPU")]
        s0, s1 = got[0], got[1]
        assert (s0.parent, s1.parent) == (0, blocks[BPC - 1])
        assert {(e.block_size, e.group_idx, e.lora_name, e.lora_id) for e in (s0, s1)} == {
            (BLOCK, 0, la.lora_name if la else None, la.lora_int_id if la else None)}
        assert {e.group_idx for e in got[2:]} == {0}
        if la is None:
            assert s0.mm_hashes == [[]] * BPC  # extra_keys is [None] * 4: no features
        else:
            # vLLM publishes the LoRA name untagged in extra_keys; llm-d's extra-key rule reads a
            # bare string as a multimodal hash, so each block gets a "multimodal" feature "ad".
            # vLLM's own GPU events carry the same extra_keys, so ours and theirs read alike.
            assert s0.mm_hashes == [["ad"]] * BPC


def test_connector_shaped_events_in_both_hash_forms_and_in_storage_read_alike() -> None:
    req = vllm_request("r", tokens_of(5, CHUNK))
    hashes = list(req.block_hashes)[:BPC]
    toks = req.all_token_ids[:CHUNK]

    def pair(form: Any, medium: str) -> list[Any]:
        return [vk.BlockStored(block_hashes=[form(h) for h in hashes], parent_block_hash=None, token_ids=toks,
                               block_size=BLOCK, lora_id=None, medium=medium, lora_name=None, extra_keys=None,
                               group_idx=0, locality="LOCAL"),
                vk.BlockRemoved(block_hashes=[form(h) for h in hashes], medium=medium, group_idx=0, locality="LOCAL")]

    read = {(form.__name__, medium): decode_batch(vllm_payload(pair(form, medium)))[1]
            for form in (u64, bytes) for medium in ("CPU", "STORAGE")}
    # vLLM's int conversion keeps the low 64 bits, llm-d's bytes rule the last 8 bytes: the same
    # number, so the int and the bytes forms of vLLM's hashes are one engine key.
    for medium in ("CPU", "STORAGE"):
        assert read["u64", medium] == read["bytes", medium]
        stored, removed = read["u64", medium]
        assert (stored.engine_keys, stored.tokens, stored.medium, removed.engine_keys, removed.medium) == (
            [u64(h) for h in hashes], toks, medium, [u64(h) for h in hashes], medium)


def test_an_llmd_index_takes_the_connectors_events_and_nothing_from_the_node_service() -> None:
    tokens = tokens_of(6, 2 * CHUNK + 5)
    req = vllm_request("r", tokens)
    index = DualKeyIndex(block_size=BLOCK)
    ev = ConnectorEvents(BLOCK, BPC)
    for c in (0, 1):
        ev.planned(req, c, f"c{c}", save_id=c)
        ev.landed(c)
    pod, model, events = decode_message([b"kv@engine-a@m", seq_bytes(0), vllm_payload(ev.take())])
    index.apply(pod, model, events)
    # Token keys: both chunks (the second through its parent) are indexed, in the CPU tier.
    assert index.holders() == {("engine-a", "cpu")}
    assert len(index.entries) == 2 * BPC
    snapshot = {k: set(v) for k, v in index.entries.items()}

    # The node service's events for the same chunks carry no tokens and keys llm-d never saw with
    # tokens: the tier-only path finds nothing to update, so NOTHING of the node service's state
    # reaches an llm-d index (stored, moved, evicted, removed or listed alike).
    payloads, _ = node_payloads(store_keys(tokens))
    for p in payloads:
        index.apply(*decode_message([b"kv@node-a@m", seq_bytes(1), p]))
    assert index.entries == snapshot

    # The connector's removals (a cache reset) take its entries out again.
    ev.reset()
    index.apply(*decode_message([b"kv@engine-a@m", seq_bytes(2), vllm_payload(ev.take())]))
    assert index.holders() == set()


def test_llmd_before_map_support_rejects_every_batch_we_send_as_it_does_vllms() -> None:
    payloads, _ = node_payloads(store_keys(tokens_of(7, 2 * CHUNK)))
    payloads.append(vllm_payload(connector_events(vllm_request("r", tokens_of(8, 2 * CHUNK)))))
    payloads.append(vllm_payload([vk.AllBlocksCleared()]))  # vLLM's own event, for comparison
    for p in payloads:
        assert decode_batch(p)  # llm-d >= v0.9.0
        # The array-only adapter (llm-d <= v0.8.1) cannot read a map-encoded event, ours or vLLM 0.32's.
        with pytest.raises(Rejected, match="map-encoded"):
            decode_batch(p, array_only=True)
    assert decode_batch(payloads[-1])[1] == [Cleared()]


@pytest.mark.parametrize(("event", "why"), [
    ({"type": "Novel"}, "unknown event tag"),
    ({"block_hashes": [1]}, "string 'type'"),
    ({"type": "BlockRemoved", "block_hashes": [b""]}, "empty hash"),
    ({"type": "BlockRemoved", "block_hashes": ["k"]}, "hash of type str"),
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": None}, "block_size"),
    ({"type": "BlockStored", "block_hashes": [1], "block_size": 0}, "token_ids"),
    ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}, "group_idx"),
])
def test_the_decoder_rejects_what_the_rules_reject(event: dict, why: str) -> None:
    payload = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}, event]])
    with pytest.raises(Rejected, match=why):
        decode_batch(payload)
