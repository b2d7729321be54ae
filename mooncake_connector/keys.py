"""Object keys for KV chunks: a deployment fingerprint plus a chained hash of the chunk's tokens.

Used by both engine connectors (vLLM scheduler and worker, SGLang's HiCache thread), in any thread;
everything here is pure and deterministic across processes and machines (no Python ``hash()``, no
per-process seed), so two engines that see the same tokens under the same fingerprint compute the
same keys.

Key text: ``"<fingerprint digest>/<chunk hash hex>"``. The fingerprint covers everything that
changes the KV bytes of a token: model id and revision, KV dtype and quantization, the canonical
layout version, the attention geometry, and the KV shard (TP rank and size), plus, when known, the
identity of the weights files, a digest of the effective model config, the cache epoch (bumped
by a cache reset) and the identity of a speculative-decoding draft model whose KV is stored too. Two deployments that differ in any of these never share a key.

Extra keys (what besides the tokens changes KV: LoRA adapter, cache salt, multimodal items, prompt
embeddings) are hashed into the chain: request-wide ones into every chunk, per-chunk ones
(``chunk_extra_keys``) only into the chunk they belong to (an image only into the chunks its
placeholder tokens overlap), so a text prefix before the first image keys as plain text does.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np
import xxhash

LAYOUT_VERSION = 1


class ModelFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must match for two writers' KV bytes of the same tokens to be interchangeable."""

    model_id: str
    kv_dtype: str  # e.g. "bfloat16", "float16", "fp8_e4m3"
    num_layers: int
    num_kv_heads: int  # per shard
    head_size: int
    shard_index: int = 0  # TP rank of the KV shard (for MLA: 0, one shard read by every rank)
    shard_count: int = 1
    revision: str | None = None
    quantization: str | None = None
    is_mla: bool = False
    layout_version: int = LAYOUT_VERSION
    # Identity of the weights files (e.g. a stamp of their names, sizes and mtimes, or a hub commit):
    # new weights at the same path never share keys with the old ones.
    weights: str | None = None
    # Cache epoch of the store this fingerprint writes to; a cache reset moves to the next one.
    epoch: int = 0
    # Digest of the effective model config the engine computes with (after its overrides: RoPE
    # parameters, sliding window, compute dtype); K is stored after RoPE, so any of these changes KV.
    config: str | None = None
    # Identity of a speculative-decoding draft model whose layers' KV is stored with the target's
    # (method, model, revision, config digest, weights stamp); None without draft KV.
    draft: str | None = None

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        for name in ("num_layers", "num_kv_heads", "head_size", "shard_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index {self.shard_index} not in [0, {self.shard_count})")
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")

    def digest(self) -> str:
        """32 hex chars identifying this fingerprint (xxh3_128 of its canonical msgpack form).

        ``weights``, ``epoch``, ``config`` and ``draft`` enter the digest only when set, so a fingerprint without them keeps
        the digest it had before they existed (stores written then stay readable, and an engine that
        does not know them, e.g. the SGLang backend, keeps matching)."""
        fields = msgspec.structs.asdict(self)
        for name in _LATE_FIELDS:
            if fields[name] == _LATE_FIELDS[name]:
                del fields[name]
        return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(fields))


# Fields added after digests were in use, with the default under which they are left out of it.
_LATE_FIELDS: dict[str, object] = {"weights": None, "epoch": 0, "config": None, "draft": None}


# A chain hash maps (parent hash or None, token ids of one chunk, extra key bytes) to a hash text.
ChainHash = Callable[[str | None, Sequence[int], bytes], str]


def _xxh3_chain(parent: str | None, tokens: Sequence[int], extra: bytes) -> str:
    h = xxhash.xxh3_128()
    h.update(b"\x00" if parent is None else parent.encode("ascii"))
    h.update(tokens.tobytes() if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(extra)
    return h.hexdigest()


_CHAIN_HASHES: dict[str, ChainHash] = {"xxh3_128": _xxh3_chain}


def register_chain_hash(name: str, fn: ChainHash) -> None:
    """Add a chain-hash scheme (e.g. one that reproduces another engine's page hashes)."""
    _CHAIN_HASHES[name] = fn


def hash_scheme_names() -> list[str]:
    """The registered chain-hash schemes' names (the config's hash_scheme choices)."""
    return sorted(_CHAIN_HASHES)


def chain_hash(name: str) -> ChainHash:
    try:
        return _CHAIN_HASHES[name]
    except KeyError:
        raise ValueError(f"unknown hash scheme {name!r}; known: {sorted(_CHAIN_HASHES)}") from None


def salt_extra_key(cache_salt: str) -> str:
    """The extra key a request's ``cache_salt`` adds to every chunk's hash (the vLLM connector's
    and a router's query alike)."""
    return f"salt:{cache_salt}"


def encode_extra_keys(extra_keys: Iterable[object] | None) -> bytes:
    """Canonical bytes of a chunk's extra keys (LoRA adapter, multimodal hashes, cache salt)."""
    if not extra_keys:
        return b""
    return msgspec.msgpack.encode([str(x) for x in extra_keys])


def chunk_hashes(
    token_ids: Sequence[int],
    chunk_tokens: int,
    *,
    extra_keys: Iterable[object] | None = None,
    scheme: str = "xxh3_128",
    parent: str | None = None,
    chunk_extra_keys: Sequence[Iterable[object] | None] | None = None,
) -> list[str]:
    """Chained hashes of every *full* chunk of ``token_ids`` (a trailing partial chunk has none).

    Each chunk's hash covers its parent's hash, so a hash names the whole prefix up to its chunk.
    ``parent`` continues a chain from an earlier call. ``extra_keys`` enter every chunk's hash;
    ``chunk_extra_keys[i]`` (optional, one entry per full chunk of this call, None or empty for
    none) enters only the i-th chunk's, after ``extra_keys``. A chunk without per-chunk keys hashes
    exactly as it would without the argument.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    fn = chain_hash(scheme)
    common = list(extra_keys) if extra_keys else []
    extra = encode_extra_keys(common)
    n_chunks = max(0, len(token_ids) // chunk_tokens)
    if chunk_extra_keys is not None and len(chunk_extra_keys) < n_chunks:
        raise ValueError(f"chunk_extra_keys has {len(chunk_extra_keys)} entries for {n_chunks} chunks")
    out: list[str] = []
    if fn is _xxh3_chain and chunk_extra_keys is None:
        # The default scheme's fast path (the same bytes as _xxh3_chain): one int64 conversion of
        # the whole prompt, each chunk hashed from a view of it.
        used = n_chunks * chunk_tokens
        raw = memoryview(np.ascontiguousarray(_int64s(token_ids if len(token_ids) == used else token_ids[:used]))).cast("B")
        step = chunk_tokens * 8
        prev = b"\x00" if parent is None else parent.encode("ascii")
        for start in range(0, n_chunks * step, step):
            h = xxhash.xxh3_128(prev)
            h.update(raw[start:start + step])
            h.update(extra)
            text = h.hexdigest()
            out.append(text)
            prev = text.encode("ascii")
        return out
    tokens = _int64s(token_ids) if scheme == "xxh3_128" else token_ids
    for i in range(n_chunks):
        start = i * chunk_tokens
        own = list(chunk_extra_keys[i] or ()) if chunk_extra_keys is not None else []
        chunk_extra = encode_extra_keys([*common, *own]) if own else extra
        parent = fn(parent, tokens[start:start + chunk_tokens], chunk_extra)
        out.append(parent)
    return out


@functools.lru_cache(maxsize=64)
def _int64_struct(n: int) -> struct.Struct:
    return struct.Struct(f"={n}q")


def as_int64(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as a native int64 array, converted the fastest way known here (the bytes the
    default scheme hashes; a caller that queries several things of one prompt converts it once)."""
    return _int64s(token_ids)


def _int64s(token_ids: Sequence[int]) -> np.ndarray:
    """The token ids as native int64s (what the xxh3 scheme hashes). A list is packed by struct,
    about three times faster than numpy's conversion of Python ints for a prompt (the same bytes);
    an array is converted by numpy."""
    if isinstance(token_ids, np.ndarray):
        return np.asarray(token_ids, dtype=np.int64)
    try:
        return np.frombuffer(_int64_struct(len(token_ids)).pack(*token_ids), dtype=np.int64)
    except struct.error:  # not plain ints (numpy scalars, out of range): numpy's rules, as before
        return np.asarray(token_ids, dtype=np.int64)


def object_key(fingerprint_digest: str, chunk_hash: str) -> str:
    return f"{fingerprint_digest}/{chunk_hash}"


def chunk_keys(
    fingerprint: ModelFingerprint,
    token_ids: Sequence[int],
    chunk_tokens: int,
    *,
    extra_keys: Iterable[object] | None = None,
    scheme: str = "xxh3_128",
) -> list[str]:
    """Store keys of every full chunk of ``token_ids`` under ``fingerprint``."""
    fp = fingerprint.digest()
    return [object_key(fp, h) for h in chunk_hashes(token_ids, chunk_tokens, extra_keys=extra_keys, scheme=scheme)]


# --- SGLang page-hash scheme ("sglang") ---------------------------------------------------------
# Reproduces SGLang 0.5.23's HiCache storage page hash (sglang/srt/mem_cache/cpp_utils/
# hash_binding.cpp, reached through mem_cache/utils.py:get_hash_str): each page's hash is
# SHA-256(parent digest (32 raw bytes, absent for the first page) || the page's token ids as
# little-endian uint32), hex-encoded; a page holding any id above 2**32 - 1 is hashed as a tag byte
# 0xff followed by the ids as little-endian uint64. With chunk_tokens equal to SGLang's page size, a
# connector using this scheme computes exactly the keys SGLang hands its storage backend, so one
# prefix cache serves both engines.
#
# Extra keys have no SGLang counterpart that can be reproduced here (SGLang seeds its chain from its
# own extra_key/cache_salt namespace): a page with extra keys hashes
# SHA-256(b"mooncake-kv/sglang-extra/v1" || extra) (32 bytes) after its parent digest (when it has
# one) and before its tokens. Every page's extra keys count, not only the first page's: a later
# chunk's own keys (an image, a slice of prompt embeddings) must change that chunk's hash. Such
# pages are never equal to an SGLang key; a page without extra keys hashes exactly as SGLang does.
# The two input forms cannot coincide for one page size (64 + 4n or 64 + 1 + 8n bytes against
# 32 + 4n or 32 + 1 + 8n, n tokens per page).

_SGLANG_EXTRA_SEED = b"mooncake-kv/sglang-extra/v1"
_U32_MAX = 0xFFFFFFFF


def sglang_page_hash(parent: str | None, tokens: Sequence[int], extra: bytes = b"") -> str:
    """SGLang's storage hash of one page of ``tokens`` chained from ``parent`` (hex), as text."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and int(ids.min()) < 0:
        raise ValueError("token ids must be non-negative")
    h = hashlib.sha256()
    if parent is not None:
        h.update(bytes.fromhex(parent))
    if extra:
        h.update(hashlib.sha256(_SGLANG_EXTRA_SEED + extra).digest())
    if ids.size and int(ids.max()) > _U32_MAX:
        h.update(b"\xff")
        h.update(ids.astype("<u8").tobytes())
    else:
        h.update(ids.astype("<u4").tobytes())
    return h.hexdigest()


register_chain_hash("sglang", sglang_page_hash)
