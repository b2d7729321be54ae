"""The scheduler's state of one live request: its chain hashes (extended as its tokens become
known), its lookup, its planned loads and saves, and what was pinned for it. Scheduler thread."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from mooncake_connector.keys import chunk_hashes
from vllm_plugin.metadata import ChunkLoad
from vllm_plugin.request_keys import chunk_extra_keys, request_extra_keys

if TYPE_CHECKING:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request


class TrackedRequest:
    """Scheduler-side state of one live request (the scheduler's own: others only read it, from
    the scheduler's thread)."""

    __slots__ = ("request", "extra", "hashes", "lookup", "lookup_chunks", "hit_chunks", "local_tokens",
                 "block_ids", "saved_chunks", "plan_loads", "remote_chunks", "remote_deadline", "stale",
                 "load_sources", "pin_from", "pin_tiers", "pin_at", "remote_node", "remote_address",
                 "transfer_id", "remote_waited", "push_node", "hits_pushed", "async_hit", "async_load",
                 "async_load_done")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.extra = request_extra_keys(request)  # in every chunk's hash; per-chunk keys come on top
        self.stale = False  # its KV predates a cache reset: never saved again
        self.hashes: list[str] = []
        self.lookup: Future | None = None
        self.lookup_chunks = 0
        self.hit_chunks = 0  # leading chunks found in the store by the last finished lookup
        self.local_tokens = 0  # vLLM's own (block-aligned) hit when the hit was computed
        self.block_ids: list[int] = []
        self.saved_chunks = 0  # chunks [0, saved_chunks) are in the store or planned for saving
        self.plan_loads: list[ChunkLoad] = []
        self.remote_chunks = 0  # chunks a prefill instance promised (disaggregated decode)
        self.remote_deadline = 0.0
        # Across nodes: the prefill node's pool id and address, and the transfer's id (its params);
        # remote_waited: a wait on that node was started (it answers once: no asking again).
        self.remote_node = ""
        self.remote_address = ""
        self.transfer_id = ""
        self.remote_waited = False
        self.push_node = ""  # P/D prefill: the decode node its chunks are pushed to as they land
        self.hits_pushed = False  # and the chunks it found stored, once
        # async_hit: the last hit was answered for a load beside the steps (a disaggregated decode's
        # prefix); async_load: its plan_loads are such a load; async_load_done: one was sent to the
        # workers (at most one per request).
        self.async_hit = False
        self.async_load = False
        self.async_load_done = False
        self.load_sources: dict[CacheHitSource, int] = {}  # the planned load's tokens by the tier holding them
        # The hit last reported to vLLM, pinned in the store when reported: chunks [pin_from,
        # pin_from + len(pin_tiers)), each one's tier, and when (monotonic) the pins were taken.
        self.pin_from = 0
        self.pin_tiers: list[str | None] = []
        self.pin_at = 0.0

    def hashes_upto(self, num_chunks: int, chunk_tokens: int, scheme: str) -> list[str]:
        """Chain hashes of the request's first ``num_chunks`` chunks of ``chunk_tokens`` tokens
        (extended incrementally; each chunk's hash covers its tokens, the request's extra keys
        and its own per-chunk keys, chained from its parent's)."""
        have = len(self.hashes)
        if num_chunks > have:
            tokens = self.request.all_token_ids
            new = tokens[have * chunk_tokens:num_chunks * chunk_tokens]
            per_chunk = chunk_extra_keys(self.request, have, num_chunks, chunk_tokens)
            self.hashes.extend(chunk_hashes(new, chunk_tokens, extra_keys=self.extra, scheme=scheme,
                                            parent=self.hashes[-1] if self.hashes else None,
                                            chunk_extra_keys=per_chunk))
        return self.hashes[:num_chunks]
