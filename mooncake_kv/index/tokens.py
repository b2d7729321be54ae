"""Token keys: the index's own names for blocks that events describe by their token ids. Pure.

An engine names its blocks by hashes only it can compute (vLLM's block hashes are seeded per
process unless the operator fixes the seed). Its ``BlockStored`` events are self-describing: the
block hashes, the parent block's hash, the token ids of every block, the block size, the LoRA name
and per-block extra keys; the connector's own events (``CPU``, ``STORAGE``) are described the same
way, with vLLM's hashes. From those the index chains its own key per block:

    key(block) = TAG + xxh3_128(key(parent) or nothing, the block's token ids as int64, extras)

where extras are the LoRA name and the block's extra keys (msgpack; none: no bytes). A router
computes the same chain over a prompt (:func:`prompt_keys`), so a query by token ids matches GPU
blocks and the connector's chunks of every engine, whatever seed its hashes use. (llm-d's indexer
keys on token content in the same spirit; its hash differs.)

:class:`TokenKeys` keeps, per source, which token key each engine hash stands for (a removal names
only the engine hash). A stored event whose parent is not known (never seen, or already removed)
cannot be chained and is left out of the token keys (counted in ``unchained``), as is one whose
token ids do not fill its blocks (``undescribed``). Not thread-safe: the index applies and
queries under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np
import xxhash

from store_backend.events.wire import BlockStored

TAG = b"\x01"  # no store key (ASCII text) starts with it

BlockHash = bytes | int


def _extras(lora_name: str | None, extra: object) -> bytes:
    if lora_name is None and not extra:
        return b""
    return msgspec.msgpack.encode([lora_name, extra if extra else None])


def chain(parent: bytes | None, tokens: np.ndarray, block_size: int, lora_name: str | None,
          extra_keys: Sequence[object] | None = None) -> list[bytes]:
    """Token keys of the whole blocks of ``tokens`` (int64), chained on ``parent`` (a token key,
    None at the start of a prompt); ``extra_keys[i]``: block i's extra keys (None: none)."""
    raw = memoryview(np.ascontiguousarray(tokens, dtype=np.int64)).cast("B")
    step = block_size * 8
    prev = parent[1:] if parent is not None else b""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        h = xxhash.xxh3_128(prev)
        h.update(raw[i * step:(i + 1) * step])
        extra = _extras(lora_name, extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None)
        if extra:
            h.update(extra)
        prev = h.digest()
        out.append(TAG + prev)
    return out


def event_extra_keys(n_blocks: int, lora_name: str | None = None,
                     cache_salt: str | None = None) -> list[tuple[str, ...] | None] | None:
    """The per-block extra keys vLLM's events carry for a text prompt of ``n_blocks`` blocks
    (``generate_block_hash_extra_keys`` then ``to_event_extra_keys``, vLLM 0.32): every block names
    the LoRA adapter; the first also the cache salt, after it. None when there are none.
    Multimodal items and prompt embeddings also enter them; a router cannot know those from token
    ids, so such prompts are not matched by tokens."""
    lora = (lora_name,) if lora_name else ()
    first = lora + ((cache_salt,) if cache_salt else ())
    if not first or n_blocks <= 0:
        return None
    return [first] + [lora or None] * (n_blocks - 1)


def prompt_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None,
                cache_salt: str | None = None) -> list[bytes]:
    """The token keys of a prompt's whole blocks of ``block_size`` tokens, as a vLLM engine's events
    key them for a request with ``lora_name`` (the adapter's name as the engine serves it) and
    ``cache_salt`` (:func:`event_extra_keys`)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    return chain(None, tokens, block_size, lora_name,
                 event_extra_keys(len(tokens) // block_size, lora_name, cache_salt))


class TokenKeys:
    """Per source: engine block hash -> token key, and the block sizes seen."""

    def __init__(self) -> None:
        self._keys: dict[str, dict[BlockHash, bytes]] = {}
        self.block_sizes: dict[int, int] = {}  # block size -> events seen with it
        self.unchained = 0
        self.undescribed = 0

    def stored(self, source: str, event: BlockStored) -> list[bytes]:
        """The token keys of ``event``'s blocks (empty: it cannot be keyed by tokens), remembered
        for the source's later removals and children."""
        n, size = len(event.block_hashes), event.block_size
        if not n or size <= 0 or len(event.token_ids) != n * size:
            if n and (event.token_ids or size > 0):
                self.undescribed += 1
            return []
        mine = self._keys.setdefault(source, {})
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent = mine.get(event.parent_block_hash)
            if parent is None:
                self.unchained += 1
                return []
        keys = chain(parent, np.asarray(event.token_ids, dtype=np.int64), size, event.lora_name, event.extra_keys)
        for h, k in zip(event.block_hashes, keys):
            mine[h] = k
        self.block_sizes[size] = self.block_sizes.get(size, 0) + 1
        return keys

    def lookup(self, source: str, hashes: Iterable[BlockHash]) -> list[bytes]:
        """The token keys the source's ``hashes`` stand for (unknown ones left out)."""
        mine = self._keys.get(source, {})
        return [k for h in hashes if (k := mine.get(h)) is not None]

    def forget(self, source: str, still_held: Callable[[bytes], bool]) -> None:
        """Drop the source's entries whose token key ``still_held`` says no medium holds."""
        mine = self._keys.get(source)
        if mine:
            for h in [h for h, k in mine.items() if not still_held(k)]:
                del mine[h]

    def forget_hashes(self, source: str, hashes: Iterable[BlockHash], still_held: Callable[[bytes], bool]) -> None:
        """Drop the entries of ``hashes`` whose token key no medium of the source holds."""
        mine = self._keys.get(source)
        if mine:
            for h in hashes:
                k = mine.get(h)
                if k is not None and not still_held(k):
                    del mine[h]

    def clear(self, source: str) -> None:
        self._keys.pop(source, None)

    def size(self) -> int:
        return sum(len(m) for m in self._keys.values())
