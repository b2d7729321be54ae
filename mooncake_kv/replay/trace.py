"""Request traces for replay: Mooncake FAST'25 jsonl and Qwen-Bailian jsonl, loaded into one shape.

Both formats are one JSON object per line with ``input_length`` and ``hash_ids``, a list of block
ids that are already prefix-chained (the same id in two requests means the same prefix up to and
including that block). They differ in units and block size:

* Mooncake (FAST'25 traces, ``timestamp`` in ms, 512-token blocks): ``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids``.
* Qwen-Bailian (``timestamp`` in s, 16-token blocks): ``chat_id``, ``parent_chat_id``, ``timestamp``,
  ``input_length``, ``output_length``, ``turn``, ``type``, ``hash_ids``.

Called from the replay driver and the CLI on the caller's thread; pure, no state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

logger = logging.getLogger(__name__)

TraceFormat = Literal["auto", "mooncake", "bailian"]

# Block size each format's hash_ids were computed with.
DEFAULT_BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}


class Request(msgspec.Struct, frozen=True):
    """One request of a trace, in the units the replay uses."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None
    type: str | None = None


class _MooncakeLine(msgspec.Struct):
    input_length: int
    hash_ids: list[int]
    timestamp: float = 0.0
    output_length: int = 0


class _BailianLine(msgspec.Struct):
    input_length: int
    hash_ids: list[int]
    timestamp: float = 0.0
    output_length: int = 0
    chat_id: int | None = None
    parent_chat_id: int | None = None
    turn: int | None = None
    type: str | None = None


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


class Trace(msgspec.Struct, frozen=True):
    """A loaded trace: requests in arrival order, and the block size of their ``hash_ids``."""

    name: str
    format: str
    block_tokens: int
    requests: tuple[Request, ...]

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def block_accesses(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    def sliced(self, max_requests: int | None) -> Trace:
        """The first ``max_requests`` requests (all of them for None)."""
        if max_requests is None or max_requests >= len(self.requests):
            return self
        return Trace(self.name, self.format, self.block_tokens, self.requests[:max_requests])


def detect_format(first_line: bytes) -> str:
    """``"bailian"`` when the line carries ``chat_id``, else ``"mooncake"``."""
    obj = msgspec.json.decode(first_line)
    if not isinstance(obj, dict):
        raise TraceError("a trace line must be a JSON object")
    return "bailian" if "chat_id" in obj or "parent_chat_id" in obj else "mooncake"


def parse_lines(
    lines: Iterable[bytes | str],
    *,
    fmt: TraceFormat = "auto",
    name: str = "trace",
    block_tokens: int | None = None,
) -> Trace:
    """Parse jsonl lines into a :class:`Trace` (raises TraceError naming the bad line).

    ``block_tokens`` defaults to the format's block size (512 Mooncake, 16 Bailian). Requests are
    sorted by timestamp (stable), as a server would see them.
    """
    requests: list[Request] = []
    decoder_mc = msgspec.json.Decoder(_MooncakeLine)
    decoder_bl = msgspec.json.Decoder(_BailianLine)
    resolved: str | None = None if fmt == "auto" else fmt
    for lineno, raw in enumerate(lines, 1):
        data = raw.encode() if isinstance(raw, str) else raw
        if not data.strip():
            continue
        try:
            if resolved is None:
                resolved = detect_format(data)
            if resolved == "mooncake":
                m = decoder_mc.decode(data)
                req = Request(m.timestamp / 1000.0, m.input_length, m.output_length, tuple(m.hash_ids))
            else:
                b = decoder_bl.decode(data)
                req = Request(b.timestamp, b.input_length, b.output_length, tuple(b.hash_ids),
                              b.chat_id, b.parent_chat_id, b.turn, b.type)
        except (msgspec.DecodeError, msgspec.ValidationError, TraceError) as e:
            raise TraceError(f"{name}:{lineno}: {e}") from None
        if req.input_length < 0:
            raise TraceError(f"{name}:{lineno}: input_length must be >= 0, got {req.input_length}")
        requests.append(req)
    resolved = resolved or (fmt if fmt != "auto" else "mooncake")
    bt = block_tokens if block_tokens is not None else DEFAULT_BLOCK_TOKENS[resolved]
    if bt <= 0:
        raise TraceError(f"block_tokens must be > 0, got {bt}")
    requests.sort(key=lambda r: r.timestamp_s)
    return Trace(name, resolved, bt, tuple(requests))


def load_trace(
    path: str | Path, *, fmt: TraceFormat = "auto", block_tokens: int | None = None,
    max_requests: int | None = None,
) -> Trace:
    """Read a jsonl trace file (see :func:`parse_lines`); ``max_requests`` keeps the first N."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            trace = parse_lines(f, fmt=fmt, name=p.stem, block_tokens=block_tokens)
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e}") from None
    logger.info("loaded %s: %d requests, format %s, %d-token blocks",
                p, len(trace.requests), trace.format, trace.block_tokens)
    return trace.sliced(max_requests)


def hit_tokens(hit_blocks: int, block_tokens: int, input_length: int) -> int:
    """Prefix tokens served from cache: whole hit blocks, capped at the request's input length."""
    return min(hit_blocks * block_tokens, input_length)


def trace_from_hash_ids(
    rows: Sequence[Sequence[int]], *, block_tokens: int = 512, input_lengths: Sequence[int] | None = None,
    name: str = "inline",
) -> Trace:
    """A trace from lists of hash ids (input length = blocks * block_tokens unless given); for tests."""
    reqs = []
    for i, ids in enumerate(rows):
        n = input_lengths[i] if input_lengths is not None else len(ids) * block_tokens
        reqs.append(Request(float(i), n, 0, tuple(ids)))
    return Trace(name, "mooncake", block_tokens, tuple(reqs))
