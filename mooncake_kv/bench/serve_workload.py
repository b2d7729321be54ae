"""The workload of ``mooncake-kv bench serve``: trace requests as token ids, and the trace's own
ceiling on the hit ratio.

A FAST'25 trace request is a list of ``hash_ids``, one per 512-token block, prefix-chained (the
same id in two requests means the same tokens up to and including that block). Each id maps to
``tokens_per_block`` deterministic token ids (a PRNG seeded with the id), so two requests that
share leading ids share exactly those leading tokens, and nothing else. Every prompt ends with one
more token of its own (seeded with the request's index): vLLM always computes a prompt's last
token, so without it a repeated prompt could never have its last block served from a cache, while
the trace's ceiling counts that block as a hit.

Pure functions, no I/O beyond reading the trace; called on the caller's thread.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mooncake_kv.replay.trace import load_trace

# Token ids below this are left alone (BOS, EOS and pad of the Llama configs here).
FIRST_TOKEN_ID = 3


@dataclass(frozen=True)
class ServeRequest:
    """One request to send: when (seconds after the run starts), what, and the trace's best case."""

    index: int
    send_at_s: float  # the trace's arrival time divided by the time scale
    prompt: list[int]
    hash_ids: tuple[int, ...]
    max_hit_blocks: int  # leading blocks an infinite cache would hold (their hash prefix seen before)
    tokens_per_block: int

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)

    @property
    def max_hit_tokens(self) -> int:
        return self.max_hit_blocks * self.tokens_per_block


def block_tokens(hash_id: int, tokens_per_block: int, vocab: int) -> list[int]:
    """The token ids of trace block ``hash_id``: a pure function of its arguments."""
    rng = random.Random(hash_id * 1_000_003 + 17)
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(tokens_per_block)]


def max_hit_blocks(hash_rows: Sequence[Sequence[int]]) -> list[int]:
    """Per request, the leading blocks whose hash id an earlier request already had (an infinite
    cache that keeps every block): ids are prefix-chained, so the first unseen id ends the hit."""
    seen: set[int] = set()
    out: list[int] = []
    for ids in hash_rows:
        k = 0
        for h in ids:
            if h not in seen:
                break
            k += 1
        out.append(k)
        seen.update(ids)
    return out


def build_workload(trace_path: Path, *, requests: int, tokens_per_block: int, time_scale: float,
                   vocab: int, start: int = 0) -> list[ServeRequest]:
    """Requests ``start`` .. ``start + requests`` of the trace as :class:`ServeRequest` (raises
    ValueError naming the bad argument; TraceError for an unreadable trace).

    Arrival times are relative to the first chosen request and divided by ``time_scale``.
    """
    if requests <= 0:
        raise ValueError(f"--requests must be > 0, got {requests}")
    if not 0 < tokens_per_block < 512:
        raise ValueError(f"--tokens-per-block must be in 1..511 (a trace block is 512 tokens), got {tokens_per_block}")
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    trace = load_trace(trace_path, max_requests=start + requests)
    chosen = trace.requests[start:start + requests]
    if not chosen:
        raise ValueError(f"{trace_path} has no requests from index {start}")
    cache: dict[int, list[int]] = {}
    hits = max_hit_blocks([r.hash_ids for r in chosen])
    t0 = chosen[0].timestamp_s
    out: list[ServeRequest] = []
    for i, (r, hit) in enumerate(zip(chosen, hits)):
        prompt: list[int] = []
        for h in r.hash_ids:
            if h not in cache:
                cache[h] = block_tokens(h, tokens_per_block, vocab)
            prompt += cache[h]
        prompt.append(random.Random(-1 - (start + i)).randrange(FIRST_TOKEN_ID, vocab))
        out.append(ServeRequest(i, (r.timestamp_s - t0) / time_scale, prompt, r.hash_ids, hit,
                                tokens_per_block))
    return out
