"""KV events of the connector, on the scheduler side: what this engine can load from the store,
published by vLLM beside its own GPU events (``take_events``), attributed to this engine.

Built from what the scheduler already knows, not from the workers (vLLM's worker-side merge keeps
an event only when every rank sent it in the same step, which loses saves ranks confirm in
different steps): a chunk is announced once the save ledger says every rank stored it.

- ``BlockStored`` (medium ``CPU``) when a chunk's save landed on every rank, once per chunk while
  it is announced. Self-describing: the engine's own block hashes of every vLLM block the chunk
  covers (converted as vLLM converts them for its events), the hash of the block before it, the
  chunk's token ids, the block size, the LoRA name and id, the per-block extra keys, group 0;
  ``locality`` ``LOCAL``. So a consumer that keys on vLLM's hashes and one that keys on tokens
  both join them with the GPU events.
- ``BlockRemoved`` (``CPU``) for every announced chunk at a cache reset (``reset_cache``: a new
  epoch, the old chunks unreachable), and for a chunk whose load failed (the worker removed a
  damaged copy, or the copy is not loadable now). Never ``AllBlocksCleared`` (it has no medium
  and would wipe the engine's GPU entries in a router).

The payload of a chunk is taken from the live request when its save is planned (``planned``) and
kept until the save settles; announced chunks keep their block hashes only (for the removal).
Bounded: at most ``max_announced`` chunks are announced at once; past it the oldest is removed
(``BlockRemoved``) before a new one is announced, so a router never holds more than the store
might.

Not announced (yet): chunks the store holds that this engine did not save (another engine, an
earlier run), the tier changes inside the store (DRAM to SSD) and the store's own evictions and
removals: the store does not report them to the scheduler. docs/ROUTING.md states these limits.
Scheduler thread only.
"""

from __future__ import annotations

import collections
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys
from vllm.v1.request import Request

LOCAL = "LOCAL"
DEFAULT_MAX_ANNOUNCED = 1 << 20


class ConnectorEvents:
    """The scheduler's KV events (see the module docstring)."""

    def __init__(self, block_size: int, blocks_per_chunk: int, *, max_announced: int = DEFAULT_MAX_ANNOUNCED) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.max_announced = max_announced
        self._pending: dict[str, BlockStored] = {}  # chunk hash -> the event to send once it lands
        self._announced: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()  # -> block hashes
        self._out: list[KVCacheEvent] = []
        self.skipped = 0  # chunks whose request had no block hashes for them (not announced)

    def planned(self, request: Request, chunk: int, chunk_hash: str) -> None:
        """A save of ``request``'s chunk ``chunk`` was planned: keep what its event will say."""
        if chunk_hash in self._pending or chunk_hash in self._announced:
            return
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk * bpc
        hashes = request.block_hashes
        if len(hashes) < first + bpc:
            self.skipped += 1
            return
        extra, mm_idx = [], 0
        for b in range(first, first + bpc):
            keys, mm_idx = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        self._pending[chunk_hash] = BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:first + bpc]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=list(request.all_token_ids[first * bs:(first + bpc) * bs]),
            block_size=bs, lora_id=lora.adapter_id if lora else None, medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra), group_idx=0,
            locality=LOCAL)

    def landed(self, chunk_hash: str) -> None:
        """Every rank stored the chunk: announce it (once)."""
        event = self._pending.pop(chunk_hash, None)
        if event is None or chunk_hash in self._announced:
            return
        while len(self._announced) >= self.max_announced:
            _old, hashes = self._announced.popitem(last=False)
            self._out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=0, locality=LOCAL))
        self._announced[chunk_hash] = list(event.block_hashes)
        self._out.append(event)

    def failed(self, chunk_hash: str) -> None:
        """The chunk's save did not land (or was discarded): forget what was kept for it."""
        self._pending.pop(chunk_hash, None)

    def gone(self, chunk_hashes: list[str]) -> None:
        """The store may no longer hold these chunks (a failed load): announce their removal."""
        for h in chunk_hashes:
            hashes = self._announced.pop(h, None)
            if hashes is not None:
                self._out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=0, locality=LOCAL))

    def reset(self) -> None:
        """A cache reset: every announced chunk is unreachable from now on."""
        self.gone(list(self._announced))
        self._pending.clear()

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        out, self._out = self._out, []
        return out

    @property
    def announced(self) -> int:
        return len(self._announced)
