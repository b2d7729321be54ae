"""The workload of ``mooncake-kv bench serve``: trace requests as token ids, and the trace's own
ceiling on the hit ratio.

A FAST'25 trace request is a list of ``hash_ids``, one per 512-token block, prefix-chained (the
same id in two requests means the same tokens up to and including that block). Each id maps to
``tokens_per_block`` deterministic token ids (a PRNG seeded with the id), so two requests that
share leading ids share exactly those leading tokens, and nothing else. Every prompt ends with one
more token of its own (seeded with the request's index): vLLM always computes a prompt's last
token, so without it a repeated prompt could never have its last block served from a cache, while
the trace's ceiling counts that block as a hit.

Two ways to choose the requests (``sample``):

- ``time``: requests ``start`` .. ``start + requests`` in arrival order.
- ``conversations``: whole multi-turn conversations, derived from the hash ids alone (the FAST'25
  trace has no conversation ids). The rule: request B *continues* an earlier request A when B's
  ``hash_ids`` start with all of A's ``hash_ids`` but A's last one (a prompt's last block is
  partial, and the next turn's prompt fills it with the answer and the next question, so its id
  changes), and that common part is longer than the prefix every request of the trace shares
  (:func:`shared_prefix_blocks`: a system prompt is no conversation). Among the requests B
  continues, its parent is the one with the longest such common part, the latest on a tie. A
  conversation is a parent with all its descendants (a tree: a turn may be continued more than
  once, a retry or a branch); only those with ``min_turns`` requests or more (default two) are
  taken. Conversations are taken whole in the order of their first request, from the ``start``-th
  such one on, skipping one that would take the total past ``requests`` or, with ``window_s``,
  one that does not end within ``window_s`` trace seconds of the first one's start; their requests are sent in arrival order at their own
  trace times (relative to the first chosen request, divided by ``time_scale``), so conversations
  interleave as in the trace.

- ``window``: every request that arrives within ``window_s`` trace seconds from ``start_s`` and
  belongs to one of every ``thin`` conversations (those whose first request's row index is a
  multiple of ``thin``), single requests and 2-turn conversations included. Conversations are the
  same trees as above, found over the whole trace, so a conversation that began before the window
  keeps its true turn numbers (its earlier turns are not sent, as on a server started at
  ``start_s``) and one that goes on after the window is cut at its end. Nothing is chosen by its
  length or its turns, so the sample reuses what the trace reuses at that time, thinned by
  ``thin`` (the requests between two turns of a conversation are thinned alike).

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
    conversation: int = -1  # trace index of the conversation's first request (-1: not sampled by conversation)
    turn: int = 0  # 1 for a conversation's first request, parent's turn + 1 after (0: not sampled by conversation)

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


def shared_prefix_blocks(hash_rows: Sequence[Sequence[int]]) -> int:
    """The number of leading hash ids every row has in common (0 for no rows)."""
    if not hash_rows:
        return 0
    first = hash_rows[0]
    n = len(first)
    for ids in hash_rows[1:]:
        k = 0
        while k < n and k < len(ids) and ids[k] == first[k]:
            k += 1
        n = k
    return n


def conversation_parents(hash_rows: Sequence[Sequence[int]], shared_blocks: int) -> list[int | None]:
    """Per row (in arrival order), the index of the earlier row it continues, or None (the rule is
    in the module docstring: B continues A when B starts with A's ids but A's last, and that common
    part is longer than ``shared_blocks``)."""
    latest: dict[tuple[int, ...], int] = {}  # A's ids but its last -> the latest such A
    out: list[int | None] = []
    for i, ids in enumerate(hash_rows):
        t = tuple(ids)
        parent = None
        for k in range(len(t), shared_blocks, -1):  # longest common part first
            j = latest.get(t[:k])
            if j is not None:
                parent = j
                break
        out.append(parent)
        if len(t) - 1 > shared_blocks:
            latest[t[:-1]] = i
    return out


def conversations(hash_rows: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """The trace's multi-turn conversations: each a list of (row index, turn) in arrival order,
    turn 1 the first request; conversations in the order of their first request; single requests
    left out."""
    root, turn = conversation_roots(hash_rows)
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, r in enumerate(root):
        groups.setdefault(r, []).append((i, turn[i]))
    return [g for _, g in sorted(groups.items()) if len(g) > 1]


def sample_conversations(hash_rows: Sequence[Sequence[int]], *, requests: int, start: int = 0,
                         min_turns: int = 2, times_s: Sequence[float] | None = None,
                         window_s: float | None = None) -> list[tuple[int, int, int]]:
    """Whole conversations of ``min_turns`` requests or more, from the ``start``-th such one on, in
    the order of their first request, each skipped when it would take the total past ``requests``:
    (row index, conversation, turn) in arrival order, ``conversation`` the index of its first row.

    With ``window_s`` (``times_s``, the rows' arrival times, is then required), only conversations
    that lie wholly within ``window_s`` seconds of the first taken one's first request: one whose
    last request comes later is skipped, and the sample ends at the first conversation that starts
    after the window (a window bounds the run's length; long conversations are what stretch it).
    """
    if window_s is not None and times_s is None:
        raise ValueError("window_s needs times_s")
    chosen: list[tuple[int, int, int]] = []
    t0: float | None = None
    for conv in [c for c in conversations(hash_rows) if len(c) >= min_turns][start:]:
        if window_s is not None:
            assert times_s is not None
            t0 = times_s[conv[0][0]] if t0 is None else t0
            if times_s[conv[0][0]] > t0 + window_s:
                break
            if times_s[conv[-1][0]] > t0 + window_s:
                continue
        if len(chosen) + len(conv) > requests:
            continue
        chosen += [(i, conv[0][0], t) for i, t in conv]
        if len(chosen) == requests:
            break
    return sorted(chosen)


def conversation_roots(hash_rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per row, the row index of its conversation's first request (itself for a single request or
    a first turn) and its turn (1 for a first request), by :func:`conversation_parents`."""
    parents = conversation_parents(hash_rows, shared_prefix_blocks(hash_rows))
    root: list[int] = []
    turn: list[int] = []
    for i, p in enumerate(parents):
        root.append(i if p is None else root[p])
        turn.append(1 if p is None else turn[p] + 1)
    return root, turn


def sample_window(hash_rows: Sequence[Sequence[int]], times_s: Sequence[float], *, start_s: float,
                  window_s: float, thin: int) -> list[tuple[int, int, int]]:
    """The rows that arrive in ``[start_s, start_s + window_s)`` and belong to a conversation whose
    first row index is a multiple of ``thin``: (row index, conversation, turn) in arrival order
    (the rule is in the module docstring)."""
    root, turn = conversation_roots(hash_rows)
    return [(i, root[i], turn[i]) for i, t in enumerate(times_s)
            if start_s <= t < start_s + window_s and root[i] % thin == 0]


SAMPLES = ("time", "conversations", "window")


def build_workload(trace_path: Path, *, requests: int, tokens_per_block: int, time_scale: float,
                   vocab: int, start: int = 0, sample: str = "time", min_turns: int = 2,
                   window_s: float | None = None, start_s: float = 0.0, thin: int = 1) -> list[ServeRequest]:
    """The chosen requests of the trace as :class:`ServeRequest`, in arrival order (raises
    ValueError naming the bad argument; TraceError for an unreadable trace). ``sample``: ``time``
    (requests ``start`` .. ``start + requests``), ``conversations`` (whole conversations of
    ``min_turns`` requests or more from the ``start``-th such one on, within ``window_s`` trace
    seconds when given; see the module docstring and :func:`sample_conversations`) or ``window``
    (one conversation in ``thin``, every request of it in ``[start_s, start_s + window_s)``, at most
    ``requests``: :func:`sample_window`).

    Arrival times are relative to the first chosen request and divided by ``time_scale``; the
    trace's ceiling (``max_hit_blocks``) is computed over exactly the chosen requests.
    """
    if sample not in SAMPLES:
        raise ValueError(f"--sample must be one of {', '.join(SAMPLES)}, got {sample!r}")
    if requests <= 0:
        raise ValueError(f"--requests must be > 0, got {requests}")
    if not 0 < tokens_per_block < 512:
        raise ValueError(f"--tokens-per-block must be in 1..511 (a trace block is 512 tokens), got {tokens_per_block}")
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    if start < 0:
        raise ValueError(f"--start must be >= 0, got {start}")
    if min_turns < 2:
        raise ValueError(f"--min-turns must be >= 2 (a conversation has two requests or more), got {min_turns}")
    if window_s is not None and window_s <= 0:
        raise ValueError(f"--window must be > 0 trace seconds, got {window_s}")
    if sample == "time" and (min_turns != 2 or window_s is not None):
        raise ValueError("--min-turns and --window choose conversations: they need --sample conversations")
    if sample != "window" and (start_s != 0.0 or thin != 1):
        raise ValueError("--start-s and --thin choose a window: they need --sample window")
    if sample == "window":
        if window_s is None:
            raise ValueError("--sample window needs --window SECONDS")
        if start_s < 0:
            raise ValueError(f"--start-s must be >= 0, got {start_s}")
        if thin < 1:
            raise ValueError(f"--thin must be >= 1, got {thin}")
        if start != 0 or min_turns != 2:
            raise ValueError("--start and --min-turns choose by index and by turns: --sample window takes "
                             "--start-s, --window and --thin")
    if sample == "time":
        trace = load_trace(trace_path, max_requests=start + requests)
        picked = [(start + i, -1, 0) for i in range(len(trace.requests[start:start + requests]))]
        if not picked:
            raise ValueError(f"{trace_path} has no requests from index {start}")
    elif sample == "window":
        trace = load_trace(trace_path)
        picked = sample_window([r.hash_ids for r in trace.requests], [r.timestamp_s for r in trace.requests],
                               start_s=start_s, window_s=float(window_s or 0), thin=thin)
        if not picked:
            raise ValueError(f"{trace_path}: no request in [{start_s:g}, {start_s + float(window_s or 0):g}) s "
                             f"of one conversation in {thin}")
        if len(picked) > requests:
            raise ValueError(f"{trace_path}: the window [{start_s:g}, {start_s + float(window_s or 0):g}) s holds "
                             f"{len(picked)} requests of one conversation in {thin}, more than --requests "
                             f"{requests}: raise --requests, or narrow the window or thin it more")
    else:
        trace = load_trace(trace_path)
        picked = sample_conversations([r.hash_ids for r in trace.requests], requests=requests, start=start,
                                      min_turns=min_turns, times_s=[r.timestamp_s for r in trace.requests],
                                      window_s=window_s)
        if not picked:
            within = "" if window_s is None else f" within {window_s:g} s"
            raise ValueError(f"{trace_path}: no conversation of {min_turns} to {requests} requests{within} "
                             f"from conversation {start} on")
    chosen = [trace.requests[i] for i, _, _ in picked]
    cache: dict[int, list[int]] = {}
    hits = max_hit_blocks([r.hash_ids for r in chosen])
    t0 = chosen[0].timestamp_s
    out: list[ServeRequest] = []
    for i, (r, hit, (row, conv, turn)) in enumerate(zip(chosen, hits, picked)):
        prompt: list[int] = []
        for h in r.hash_ids:
            if h not in cache:
                cache[h] = block_tokens(h, tokens_per_block, vocab)
            prompt += cache[h]
        # Seeded with the trace row, so a request's own token does not depend on the sample.
        prompt.append(random.Random(-1 - row).randrange(FIRST_TOKEN_ID, vocab))
        out.append(ServeRequest(i, (r.timestamp_s - t0) / time_scale, prompt, r.hash_ids, hit,
                                tokens_per_block, conv, turn))
    return out
