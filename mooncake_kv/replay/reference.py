"""Offline reference hit ratios for a trace: the maximum (infinite cache) and Belady's optimum.

Both are computed directly over ``hash_ids`` with the replay's accounting (a request's hit is its
run of leading cached blocks, in tokens, capped at its input length; after the lookup every block of
the request is stored, as an engine does after prefill). They need the whole trace up front, so no
online policy can reach them; they bound what the store's policies can do.

Pure functions, called from the replay driver on the caller's thread.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import Any

import msgspec

from mooncake_kv.replay.trace import Request, Trace, hit_tokens

NEVER = 1 << 62  # next use of a block that is never used again


class HitStats(msgspec.Struct):
    """Prefix-token hits of one replay (per tier where a tier is named)."""

    input_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    requests: int = 0
    tier_hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    store_metrics: dict[str, Any] = msgspec.field(default_factory=dict)  # the store's, when one ran

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def tier_ratio(self, tier: str) -> float:
        return self.tier_hit_tokens.get(tier, 0) / self.input_tokens if self.input_tokens else 0.0

    def add(self, input_length: int, hit_tokens_: int, hit_blocks: int) -> None:
        self.requests += 1
        self.input_tokens += input_length
        self.hit_tokens += hit_tokens_
        self.hit_blocks += hit_blocks


def _count_lookup(out: HitStats, req: Request, resident: Container[int], block_tokens: int) -> int:
    """Add one request's lookup to ``out``: its leading blocks found in ``resident``; returns them."""
    ids = req.hash_ids
    k = 0
    while k < len(ids) and ids[k] in resident:
        k += 1
    out.add(req.input_length, hit_tokens(k, block_tokens, req.input_length), k)
    return k


def speedup(ratio: float) -> float:
    """Ideal prefill speed-up at prefix hit ratio ``ratio``: 1 / (1 - r)."""
    return float("inf") if ratio >= 1.0 else 1.0 / (1.0 - ratio)


def max_hits(trace: Trace) -> HitStats:
    """Hits with an unbounded cache: every block ever seen stays."""
    seen: set[int] = set()
    out = HitStats()
    bt = trace.block_tokens
    for req in trace.requests:
        _count_lookup(out, req, seen, bt)
        seen.update(req.hash_ids)
    return out


def next_uses(trace: Trace) -> list[list[int]]:
    """For each request and block position, the index of the next request using that block (or NEVER)."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(trace.requests)
    for r in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[r].hash_ids
        row = [last.get(b, NEVER) for b in ids]
        for b in ids:
            last[b] = r
        out[r] = row
    return out


def belady_hits(trace: Trace, capacity_blocks: int, nxt: Sequence[Sequence[int]] | None = None) -> HitStats:
    """Belady's MIN with bypass at a capacity of ``capacity_blocks`` blocks.

    When a block must be stored into a full cache, the resident block whose next use is farthest is
    evicted, unless the new block's own next use is farther still (then the new block is not stored).
    Ties go to the deeper block (later in its prefix), so the cache stays prefix-closed: a parent is
    always used whenever its child is, so it is never evicted before it. ``nxt`` may pass a
    precomputed :func:`next_uses` to share it across capacities.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if nxt is None:
        nxt = next_uses(trace)
    return _ranked_cache_hits(trace, capacity_blocks, lambda r, d: (-nxt[r][d], -d), lambda r, d: nxt[r][d] == NEVER)


def _ranked_cache_hits(
    trace: Trace,
    capacity_blocks: int,
    rank: Callable[[int, int], tuple[int, ...]],
    dead: Callable[[int, int], bool],
) -> HitStats:
    """An offline cache run by a rank: the block at position ``d`` of request ``r`` gets
    ``rank(r, d)`` when requested; the resident block with the smallest rank is evicted, and a new
    block ranked no higher than it, or ``dead(r, d)``, is not stored at all."""
    resident: dict[int, tuple[int, ...]] = {}  # block -> its current rank
    heap: list[tuple[tuple[int, ...], int]] = []  # (rank, block); stale entries skipped
    out = HitStats()
    bt = trace.block_tokens
    push, pop = heapq.heappush, heapq.heappop
    for r, req in enumerate(trace.requests):
        _count_lookup(out, req, resident, bt)
        for depth, b in enumerate(req.hash_ids):
            key = rank(r, depth)
            if b in resident:
                resident[b] = key
                push(heap, (key, b))
                continue
            if capacity_blocks == 0 or dead(r, depth):
                continue
            if len(resident) >= capacity_blocks:
                while resident.get(heap[0][1]) != heap[0][0]:  # the lowest-ranked live entry
                    pop(heap)
                if key <= heap[0][0]:
                    continue  # the new block ranks lowest: bypass it
                del resident[pop(heap)[1]]
            resident[b] = key
            push(heap, (key, b))
    return out


def dead_block_oracle_lru_hits(
    trace: Trace, capacity_blocks: int, nxt: Sequence[Sequence[int]] | None = None
) -> HitStats:
    """LRU that is told, for free, which blocks will never be used again (offline, a bound).

    Dead blocks are never stored and are evicted first if they become dead while resident; live
    ones are evicted least recently used first. It measures how much of the LRU-to-Belady gap
    perfect *liveness* prediction could close at most for a recency-ordered policy: the rest of
    Belady's advantage comes from knowing *when* each block is used next.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if nxt is None:
        nxt = next_uses(trace)
    live: OrderedDict[int, None] = OrderedDict()
    dead: OrderedDict[int, None] = OrderedDict()
    out = HitStats()
    bt = trace.block_tokens
    for r, req in enumerate(trace.requests):
        ids = req.hash_ids
        k = 0
        while k < len(ids) and (ids[k] in live or ids[k] in dead):
            k += 1
        out.add(req.input_length, hit_tokens(k, bt, req.input_length), k)
        for depth, b in enumerate(ids):
            is_dead = nxt[r][depth] == NEVER
            if b in live:
                del live[b]
            elif b in dead:
                del dead[b]
            else:
                if is_dead or capacity_blocks == 0:
                    continue
                if len(live) + len(dead) >= capacity_blocks:
                    (dead if dead else live).popitem(last=False)
            (dead if is_dead else live)[b] = None
    return out


def remaining_uses(trace: Trace) -> list[list[int]]:
    """For each request and block position, how many later requests use that block."""
    count: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(trace.requests)
    for r in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[r].hash_ids
        out[r] = [count.get(b, 0) for b in ids]
        for b in set(ids):
            count[b] = count.get(b, 0) + 1
    return out


def frequency_oracle_hits(
    trace: Trace, capacity_blocks: int, remaining: Sequence[Sequence[int]] | None = None
) -> HitStats:
    """LFU told, for free, how many more times each block will be requested, but not when (offline).

    The resident block with the fewest remaining uses is evicted (ties: the least recently used,
    then the deeper block, so the cache stays prefix-closed); a new block with no remaining use, or
    fewer than every resident block, is not stored. It bounds what any policy that predicts *how
    often* blocks come back (frequency, reuse probability, per-class statistics) can reach: the rest of
    Belady's lead comes from knowing *when* each block is used next, which nothing online sees.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if remaining is None:
        remaining = remaining_uses(trace)
    return _ranked_cache_hits(trace, capacity_blocks, lambda r, d: (remaining[r][d], r, -d),
                              lambda r, d: remaining[r][d] == 0)
