"""The node service's control protocol: every frame a client and the service exchange, and its codec.

Wire format (shared with the lookup service, :mod:`store_backend.framing`): a 4-byte little-endian
length, then one msgpack-encoded :data:`Frame`, at most :data:`~store_backend.framing.MAX_FRAME_BYTES`
(8 MiB; a client splits longer key lists). Every frame is a ``msgspec.Struct`` encoded as an array
whose first element is its tag (``array_like=True``), so one decoder reads the whole tagged union
and an unknown tag or a wrong field is a :class:`~store_backend.framing.FrameError` naming it.

Conversation: the client's first frame is :class:`Hello`; the service answers :class:`Welcome`
(with the arena segment's fd alongside when ``want_segment``, see :mod:`store_backend.node.fdpass`)
or :class:`Error`. Every request carries an ``id`` (> 0) that its reply echoes; one request is in
flight per connection. A push from the service (:class:`Draining`) has ``id`` 0. Bytes of objects
never travel here: a :class:`Grant` names an offset into the shared segment, and the client copies
into or out of its own mapping of it.

Tokens name one reservation or lease, held by the client *process* that took it: any connection
of that process may commit, abort or release it (a token of another process answers IO_ERROR /
False for that token, and changes nothing). A connection that ends takes nothing with it: the
process's tokens stay until it ends them, says they are void (:class:`Forget`), or exits (the
service watches it). Statuses are :class:`store_backend.types.Status` values.

Nothing here touches a socket except :class:`FrameReader` (blocking, one per connection); the
asyncio server feeds a :class:`MessageDecoder` with what arrives. Not thread-safe: one reader and one
writer per connection.
"""

from __future__ import annotations

import socket
import time
from typing import Literal, Union

import msgspec

from store_backend.framing import (
    MAX_FRAME_BYTES,
    FrameDecoder,
    FrameError,
    FrameTooLargeError,
    frame,
    read_frame,
)
from store_backend.metrics import StoreStats
from store_backend.types import Status

# 2: tokens belong to the client process, Forget, Grant.checksum and Commit.checksums.
PROTOCOL_VERSION = 2

ErrorCode = Literal["bad_request", "too_large", "closed", "permission", "version", "busy", "internal"]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]


class _Frame(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of every frame (array-encoded, tagged by the first element)."""


# -- requests (client → service) -------------------------------------------------------------------
class Hello(_Frame, tag="hello"):
    """First frame of a connection. ``want_segment``: send the arena segment's fd with the reply
    (a status probe does not map it)."""

    id: int
    version: int
    pid: int
    name: str
    want_segment: bool = True


class Exists(_Frame, tag="exists"):
    """Leading keys present. ``count_reserved``: saves in flight count; ``wait_s`` > 0: answer when
    all are committed or at the deadline."""

    id: int
    keys: list[str]
    count_reserved: bool = False
    wait_s: float = 0.0


class ExistsAll(_Frame, tag="exists_all"):
    """The shortest leading run present over several key lists (all TP ranks in one round trip)."""

    id: int
    key_lists: list[list[str]]
    count_reserved: bool = False


class Contains(_Frame, tag="contains"):
    id: int
    keys: list[str]


class SizeOf(_Frame, tag="size_of"):
    id: int
    keys: list[str]


class TierOf(_Frame, tag="tier_of"):
    id: int
    keys: list[str]


class Pin(_Frame, tag="pin"):
    """Key-counted pins with a TTL, counted against the pinning process's share of the arena (a
    key past it answers False) and ended when that process exits; they outlive the connection
    (they bridge a lookup in one process and a load in another, whose unpin ends them)."""

    id: int
    keys: list[str]
    ttl_s: float


class Unpin(_Frame, tag="unpin"):
    id: int
    keys: list[str]


class Reserve(_Frame, tag="reserve"):
    """Slots to write objects into; invisible to every reader until committed. ``room_wait_s``:
    how long a key refused for want of clean DRAM (full of objects not yet on SSD) may wait for the
    offload to make room (None: the service's ``offload.put_wait_s``; 0: never)."""

    id: int
    keys: list[str]
    sizes: list[int]
    parents: list[str | None] | None = None
    ttl_s: float = 60.0
    room_wait_s: float | None = 0.0


class Commit(_Frame, tag="commit"):
    """``checksums``: per token the writer's object checksum of what it wrote
    (:func:`store_backend.checksum.object_checksum`), kept with the object and handed to every
    reader; None (or a None item): the service computes it over the slot."""

    id: int
    tokens: list[int]
    checksums: list[int | None] | None = None


class Abort(_Frame, tag="abort"):
    id: int
    tokens: list[int]


class Lease(_Frame, tag="lease"):
    """Slots to read objects from; the bytes stay put until released. ``stage_in``: bring an object
    that is only below DRAM into a slot; ``wait_pending_s``: wait that long for a reserved key to
    be committed."""

    id: int
    keys: list[str]
    ttl_s: float = 60.0
    stage_in: bool = True
    wait_pending_s: float = 0.0


class Release(_Frame, tag="release"):
    id: int
    tokens: list[int]


class Remove(_Frame, tag="remove"):
    id: int
    keys: list[str]


class Keys(_Frame, tag="keys"):
    """One page of the stored keys starting with ``prefix``, from ``cursor`` (empty: the start)."""

    id: int
    prefix: str = ""
    cursor: str = ""
    limit: int = 10000


class Flush(_Frame, tag="flush"):
    id: int
    timeout_s: float | None = None


class WaitPeer(_Frame, tag="wait_peer"):
    """Wait (up to ``wait_s``) until the pool node ``node`` has committed every key (a prefill
    node's saves, named by the decode request's transfer parameters), then answer :class:`Count`:
    the leading keys it holds. Those are read from ``node`` first from then on (see
    ``store_backend.pool.tier.PoolTier.wait_at``). ``address``: the node's pool address ("" : the
    directory's). A service without a pool answers ``bad_request``."""

    id: int
    node: str
    keys: list[str]
    wait_s: float
    address: str = ""
    transfer_id: str = ""


class Push(_Frame, tag="push"):
    """Copy ``keys`` (this node's own objects) to the pool node ``node``, in the background (a
    prefill node pushing a transfer's chunks to its decode node as they are committed): answered
    at once with :class:`Count`, the keys queued (0: dropped, counted). A service without a pool
    answers ``bad_request``."""

    id: int
    node: str
    keys: list[str]


class Stats(_Frame, tag="stats"):
    """``mine``: this connection's own counters rather than the whole store's."""

    id: int
    mine: bool = False


class Shutdown(_Frame, tag="shutdown"):
    """Stop the service as SIGTERM does (``mooncake-kv stop``)."""

    id: int


class Goodbye(_Frame, tag="goodbye"):
    """The client is done with this connection: the service closes it. The process's tokens stay
    (a thread of it may still be copying through one); end them with commit/abort/release, or
    :class:`Forget`."""

    id: int


class Forget(_Frame, tag="forget"):
    """The client lost connections ``conn_ids`` (from their welcomes): every token taken on them
    is void except those in ``keep`` (the client handed those out and will end them itself). A
    reply lost on the way may have granted tokens the client never learned of; this gives them
    back. Connections of another process, or unknown, are skipped; one still open is closed first.
    Answered with :class:`Count`: the tokens ended."""

    id: int
    conn_ids: list[int]
    keep: list[int] = msgspec.field(default_factory=list)


# -- replies and pushes (service → client) ---------------------------------------------------------
class Welcome(_Frame, tag="welcome"):
    """The service is ready for this connection. ``segment_id``: ``"<st_dev>:<st_ino>"`` of the
    segment whose fd comes with this frame (the client checks it against ``fstat``)."""

    id: int
    version: int
    service_pid: int
    conn_id: int
    segment_id: str
    segment_bytes: int
    alignment_bytes: int
    max_frame_bytes: int
    ttl_max_s: float
    tiers: list[str]
    ssd_path: str | None = None
    verify_reads: bool = False  # objects carry their writer's checksum; clients verify by default
    put_wait_s: float = 0.0  # the longest a reserve with room_wait_s None waits for room
    pool_node: str = ""  # this node's id in its pool ("": no pool)
    pool_address: str = ""  # its pool transport address, as its peers reach it


class Count(_Frame, tag="count"):
    id: int
    n: int


class Bools(_Frame, tag="bools"):
    id: int
    values: list[bool]


class Sizes(_Frame, tag="sizes"):
    id: int
    values: list[int | None]


class Names(_Frame, tag="names"):
    id: int
    values: list[str | None]


class Ack(_Frame, tag="ack"):
    id: int


class Grant(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One key's slot: ``offset`` and ``nbytes`` into the segment when ``status`` is OK. A lease's
    ``checksum``: the object checksum its writer gave (the reader verifies its copy against it)."""

    status: Status
    token: int = 0
    offset: int = 0
    nbytes: int = 0
    checksum: int | None = None


class Slots(_Frame, tag="slots"):
    id: int
    grants: list[Grant]


class Statuses(_Frame, tag="statuses"):
    id: int
    values: list[Status]


class KeyPage(_Frame, tag="key_page"):
    """``cursor``: pass it back for the next page; empty when this was the last."""

    id: int
    keys: list[str]
    cursor: str = ""


class FlushResult(_Frame, tag="flush_result"):
    """``unpersisted``: the first objects not persisted (at most 1000), key → why."""

    id: int
    ok: bool
    unpersisted: dict[str, str] = msgspec.field(default_factory=dict)
    declined: int = 0
    lost_untracked: int = 0


class ClientInfo(msgspec.Struct, forbid_unknown_fields=True):
    """One attached connection as the service sees it (``status`` lists them)."""

    conn_id: int
    pid: int
    uid: int
    name: str = ""
    reservations: int = 0
    leases: int = 0
    held_bytes: int = 0
    connected_s: float = 0.0  # seconds since it connected


class NodeStats(msgspec.Struct, forbid_unknown_fields=True):
    """The service's own gauges and counters beside the store's."""

    connections: int = 0
    reservations: int = 0
    leases: int = 0
    held_bytes: int = 0
    zombie_bytes: int = 0  # held by reservations past their TTL whose process still runs
    bad_frames: int = 0
    frames: dict[str, int] = msgspec.field(default_factory=dict)  # by op
    # Who and where (added for ``status``; defaults keep older frames decodable).
    pid: int = 0
    uptime_s: float = 0.0
    socket: str = ""
    segment_path: str = ""
    segment_id: str = ""
    segment_bytes: int = 0
    auto_started: bool = False
    started_by: int | None = None
    draining: bool = False
    loop_lag_s: float = 0.0
    metrics_address: str = ""  # host:port of /metrics, "" when not served
    clients: list[ClientInfo] = msgspec.field(default_factory=list)
    metrics_off: str = ""  # why /metrics is not served although configured ("" otherwise)
    processes: int = 0  # client processes known (connected, or holding tokens or pins)
    orphaned: int = 0  # tokens whose connection ended while their process still runs
    leases_expired: int = 0  # leases ended by the service past their TTL (their release answers False)
    # Bytes held for clients' frames (incomplete, queued, being answered) and replies being sent,
    # all connections (besides the stats request asking).
    buffered_bytes: int = 0
    # KV events (section `events`): the bound PUB and replay endpoints and the backend id, "" when off.
    events_endpoint: str = ""
    events_replay_endpoint: str = ""
    events_backend_id: str = ""


class StatsReply(_Frame, tag="stats_reply"):
    id: int
    store: StoreStats
    node: NodeStats = msgspec.field(default_factory=NodeStats)


class Draining(_Frame, tag="draining"):
    """Push (id 0) to every connection at SIGTERM: new reserve/lease are refused from now on, open
    tokens have ``deadline_s`` to finish."""

    id: int
    deadline_s: float


class Error(_Frame, tag="error"):
    """A refused request (``id`` echoes it; 0 when the frame could not be read)."""

    id: int
    code: ErrorCode
    message: str


Request = Union[Hello, Exists, ExistsAll, Contains, SizeOf, TierOf, Pin, Unpin, Reserve, Commit, Abort,
                Lease, Release, Remove, Keys, Flush, Stats, Shutdown, Goodbye, Forget, WaitPeer, Push]
Reply = Union[Welcome, Count, Bools, Sizes, Names, Ack, Slots, Statuses, KeyPage, FlushResult, StatsReply,
              Draining, Error]
Frame = Union[Request, Reply]

REQUEST_TYPES: tuple[type, ...] = Request.__args__  # type: ignore[attr-defined]
REPLY_TYPES: tuple[type, ...] = Reply.__args__  # type: ignore[attr-defined]

_encoder = msgspec.msgpack.Encoder()


def encode(message: Frame, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``message`` as one frame, length prefix included; FrameError when it is over the cap (the
    caller splits its key lists)."""
    return frame(_encoder.encode(message), max_frame_bytes)


def error_for(exc: FrameError, request_id: int = 0) -> Error:
    """The reply a service sends before closing a connection whose bytes broke the protocol:
    ``too_large`` for a length over the cap, else ``bad_request``, with the error's own message."""
    code: ErrorCode = "too_large" if isinstance(exc, FrameTooLargeError) else "bad_request"
    return Error(request_id, code, str(exc))


class MessageDecoder:
    """Frames from a byte stream as it arrives (sans-I/O): ``feed(data)`` returns the messages
    ``data`` completed. Raises only :class:`FrameError`, naming what was wrong (an oversized
    length, an undecodable body, an unknown op, a field of the wrong type, a frame the stream cut
    short at ``eof()``); after one, the connection is to be closed. Buffers at most a frame's
    header plus ``max_frame_bytes``. ``expect``: :data:`Request` (the service) or :data:`Reply`
    (a client)."""

    def __init__(self, expect: object = Frame, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.frames = FrameDecoder(max_frame_bytes)
        self._decoder = msgspec.msgpack.Decoder(expect)

    @property
    def buffered_bytes(self) -> int:
        return self.frames.buffered_bytes

    def decode(self, body: bytes) -> Frame:
        """One frame's body as its message; FrameError naming what was wrong."""
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            raise FrameError(f"a {len(body)}-byte frame does not fit the protocol: {e}") from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise FrameError(f"a {len(body)}-byte frame is not valid msgpack: {e}") from None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        return [self.decode(body) for body in self.frames.feed(data)]

    def eof(self) -> None:
        self.frames.eof()


class FrameReader:
    """Blocking reads of whole messages from one connected socket, each within a deadline.

    ``read(timeout_s)``: the next message; None at a clean end of stream. :class:`FrameError` for
    a broken frame; :class:`~store_backend.framing.FrameTimeoutError` when the frame did not
    complete within ``timeout_s`` (the deadline covers the whole frame, however its bytes
    trickle in). Other socket errors (a reset) pass through as OSError.
    """

    def __init__(self, sock: socket.socket, expect: object = Frame, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.decoder = MessageDecoder(expect, max_frame_bytes)
        self._pending: list[bytes] = []

    def read(self, timeout_s: float | None = None) -> Frame | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        body = read_frame(self.sock, self.decoder.frames, self._pending, deadline)
        return None if body is None else self.decoder.decode(body)
