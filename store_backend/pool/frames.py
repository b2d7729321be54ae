"""The pool transport's wire format: msgpack control headers and raw payloads on a TCP stream.

A frame is a 4-byte big-endian header length (at most :data:`MAX_HEADER_BYTES`), a msgspec msgpack
:class:`Header`, then, for the ops that carry objects, the objects' raw bytes back to back in the
order and sizes the header names. Exchanges (``req`` numbers a request; its answers repeat it):

- get: ``get`` (keys, sizes = the reader's buffer capacities, optionally checksums = what the
  reader will verify each object against, the directory's record; 0 = none) -> ``get_reply`` (statuses, sizes)
  -> the payload of every OK key -> ``get_ack`` from the reader once it has all of it ->
  ``get_end`` (statuses: OK, or IO_ERROR where the lease's release said the bytes may have
  changed while they were sent; checksums: keyed xxh3-64 per OK key, masked (see :class:`Session`),
  0 where the request named one: the reader checks those against its own record, so the server
  need not hash them). The server releases its leases
  only after ``get_ack``: ``sendfile`` queues references to the arena's pages, not copies, so a
  slot released (and reused) before the reader copied them out would change bytes in flight.
- put: ``put`` (keys, sizes) -> ``put_accept`` (statuses: OK = send it) -> the payload of every
  accepted key -> ``put_end`` (checksums of the sent keys) -> ``put_reply`` (statuses).
- remove: ``remove`` (keys, optionally ``before_s``) -> ``remove_reply`` (statuses). ``before_s``
  > 0 (a retried remove: the wall-clock seconds, on the remover's clock, at which the remove was
  made) limits it to copies not known to be committed after that time (see
  :meth:`store_backend.pool.transport.Transport.remove`).
- wait: ``wait`` (keys, ``wait_s``) -> ``wait_reply`` (statuses: OK for each of the leading keys
  committed on the server's own tiers, NOT_FOUND from the first that is not; sizes: the OK
  objects' sizes, 0 for the others), sent as soon as every key is committed there, or when
  ``wait_s`` (at most :data:`MAX_WAIT_S`) passed: the readiness signal a decode node waits on for a
  prefill node's saves.
- ``error`` (error text) answers anything the peer refuses; the connection is closed after it.
- Handshake (:mod:`store_backend.pool.auth`): ``auth_ok`` carries the server's proof. Every frame
  after it ends with a :data:`TAG_BYTES` tag, and payload checksums are keyed (:class:`Session`).

Checksums travel *after* the payload so that each side hashes one object while the next one is on
the wire (hashing holds a core for about a third of the time a Python socket takes to move the
same bytes).

Every decoded header is validated by :func:`validate` (types, counts equal, sizes within
``[0, max_object_bytes]``, keys valid, statuses known) and anything else is a :class:`FrameError`
naming the field; the reader then closes the connection. Payloads are received with ``recv_into``
straight into the destination's memoryview (:func:`recv_exactly_into`), never through a bytes
object. Nothing here is thread-safe: one reader and one writer per socket at a time. All calls
block, bounded by the deadline they are given (``time.monotonic()`` seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import select
import socket
import struct
import time
from typing import Any

import msgspec

from store_backend.types import Status, check_key

LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20
MAX_U64 = (1 << 64) - 1
# One recv_into asks for at most this much: large enough to drain a big socket buffer in one call.
RECV_PIECE_BYTES = 8 << 20
# Payload pieces hashed inline: small enough to stay in a core's L2 between the copy and the hash.
HASH_PIECE_BYTES = 256 << 10
# A payload's receive may overrun its deadline by at most this (see recv_exactly_into).
_RETIME_S = 0.05
# Every frame after the handshake ends with this many bytes of HMAC-SHA256 (see Session).
TAG_BYTES = 32

OPS = ("get", "get_reply", "get_ack", "get_end", "put", "put_accept", "put_end", "put_reply", "remove", "remove_reply",
       "wait", "wait_reply", "error", "auth_ok")
REQUEST_OPS = ("get", "put", "remove", "wait")
# The longest a wait request may ask the server to hold it.
MAX_WAIT_S = 600.0
_STATUSES = frozenset(int(s) for s in Status)


class FrameError(ValueError):
    """Bytes that break the wire format (a length over the cap, an undecodable header, a field of
    the wrong type or count, a size out of range, an invalid key). The message names the field."""


class TagError(FrameError):
    """A frame's tag is wrong: it was changed on the way, replayed, reordered, or sent by someone
    without the session's key. The reader closes the connection."""


class PeerClosedError(ConnectionError):
    """The peer ended the stream (inside a frame, or before one)."""


class Header(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One control header; which fields an op uses is in the module docstring."""

    op: str
    req: int = 0
    keys: list[str] = []
    sizes: list[int] = []
    checksums: list[int] = []
    statuses: list[int] = []
    error: str = ""
    proof: bytes = b""  # handshake only: the server's HMAC
    before_s: float = 0.0  # remove only: see the module docstring (0: every copy)
    wait_s: float = 0.0  # wait only: how long the server may hold the request


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Header)


class Session:
    """The keys of one authenticated connection, derived from the handshake (see
    :mod:`store_backend.pool.auth`): ``key`` = HMAC(secret, ``"k"`` + both nonces).

    - Every frame after the handshake carries ``TAG_BYTES`` of HMAC-SHA256(key, direction +
      the frame's 8-byte index in that direction + length prefix + header). A frame changed, dropped,
      replayed or reordered on the way fails its tag (:class:`TagError`).
    - Payload checksums are xxh3-64 with a secret seed per object, and travel masked (XOR a
      secret pad), both from SHAKE-128(key, ``"p"`` + direction + the index of the header the
      payload follows): a relay without the secret cannot compute the checksum of bytes it rewrote,
      nor learn the seed from what it sees. xxh3 with a secret seed is NOT a cryptographic MAC
      (crafted collisions independent of the seed may exist); on an untrusted network run the pool
      inside a private network or a TLS/WireGuard tunnel.

    The send and receive counters are separate: one writer and one reader may use a session at
    the same time, never two of either."""

    __slots__ = ("_key", "_out", "_in", "sent", "received")

    def __init__(self, key: bytes, is_server: bool) -> None:
        self._key = key
        self._out, self._in = (b"s", b"c") if is_server else (b"c", b"s")
        self.sent = 0  # frames sent so far; the next one's index
        self.received = 0

    def _tag(self, direction: bytes, index: int, data: bytes | bytearray | memoryview) -> bytes:
        return hmac.digest(self._key, direction + index.to_bytes(8, "big") + bytes(data), "sha256")

    def seal(self, frame: bytes) -> bytes:
        """``frame`` (length prefix + header) with its tag; counts it as sent."""
        tag = self._tag(self._out, self.sent, frame)
        self.sent += 1
        return frame + tag

    def check(self, frame: bytes | bytearray | memoryview, tag: bytes | bytearray | memoryview) -> None:
        """TagError unless ``tag`` is the next received frame's; counts it as received."""
        if not hmac.compare_digest(bytes(tag), self._tag(self._in, self.received, frame)):
            raise TagError(f"tag: frame {self.received} from the peer fails its tag (changed on the way, "
                           "replayed, or not from a holder of the secret)")
        self.received += 1

    def payload_keys(self, outgoing: bool, index: int, n: int) -> list[tuple[int, int]]:
        """``(seed, mask)`` for each of the ``n`` objects that follow the frame ``index`` sent
        (``outgoing``) or received by this side; the peer derives the same ones."""
        d = self._out if outgoing else self._in
        raw = hashlib.shake_128(self._key + b"p" + d + index.to_bytes(8, "big")).digest(16 * n)
        return [(int.from_bytes(raw[16 * i:16 * i + 8], "big"), int.from_bytes(raw[16 * i + 8:16 * i + 16], "big"))
                for i in range(n)]


def encode(header: Header) -> bytes:
    """``header`` with its length prefix; FrameError when it is over :data:`MAX_HEADER_BYTES`."""
    body = _ENCODER.encode(header)
    if len(body) > MAX_HEADER_BYTES:
        raise FrameError(f"a header of {len(body)} bytes is larger than the {MAX_HEADER_BYTES}-byte limit "
                         f"({len(header.keys)} keys): split the batch")
    return LEN.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview) -> Header:
    """Decode one header body; FrameError naming what was wrong."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as e:
        raise FrameError(f"header does not match the schema: {e}") from None
    except msgspec.DecodeError as e:
        raise FrameError(f"header is not valid msgpack: {e}") from None


def validate(h: Header, max_object_bytes: int) -> Header:
    """Check ``h`` beyond its schema; returns it, or raises FrameError naming the field."""
    if h.op not in OPS:
        raise FrameError(f"op: unknown op {h.op[:40]!r}")
    if not 0 <= h.req <= MAX_U64:
        raise FrameError(f"req: {h.req} is not a 64-bit unsigned number")
    n = len(h.keys)
    for i, key in enumerate(h.keys):
        why = check_key(key)
        if why is not None:
            raise FrameError(f"keys[{i}]: {why}")
    if h.op in REQUEST_OPS and n == 0:
        raise FrameError(f"keys: a {h.op} request names no keys")
    if h.op in ("get", "put") and len(h.sizes) != n:
        raise FrameError(f"sizes: {len(h.sizes)} sizes for {n} keys")
    if h.op in ("get_reply", "wait_reply") and len(h.sizes) != len(h.statuses):
        raise FrameError(f"sizes: {len(h.sizes)} sizes for {len(h.statuses)} statuses")
    # A get names the reader's buffer capacities, which may be anything; every other size is an object's.
    top, what = (MAX_U64, "a 64-bit size") if h.op == "get" else (max_object_bytes, "max_object_bytes")
    for i, size in enumerate(h.sizes):
        if not 0 <= size <= top:
            raise FrameError(f"sizes[{i}]: {size} is outside [0, {top}] ({what})")
    for i, c in enumerate(h.checksums):
        if not 0 <= c <= MAX_U64:
            raise FrameError(f"checksums[{i}]: {c} is not a 64-bit unsigned number")
    for i, s in enumerate(h.statuses):
        if s not in _STATUSES:
            raise FrameError(f"statuses[{i}]: {s} is not a known status")
    if h.op == "get" and h.checksums and len(h.checksums) != n:
        raise FrameError(f"checksums: {len(h.checksums)} checksums for {n} keys")
    if h.op == "get_end" and len(h.checksums) != len(h.statuses):
        raise FrameError(f"checksums: {len(h.checksums)} checksums for {len(h.statuses)} statuses")
    if len(h.error) > 4096:
        raise FrameError(f"error: {len(h.error)} characters, more than 4096")
    if h.before_s and (h.op != "remove" or not math.isfinite(h.before_s) or h.before_s < 0):
        raise FrameError(f"before_s: {h.before_s!r} is not a time of a remove (a finite number >= 0, "
                         f"remove requests only)")
    if h.wait_s and (h.op != "wait" or not math.isfinite(h.wait_s) or not 0 <= h.wait_s <= MAX_WAIT_S):
        raise FrameError(f"wait_s: {h.wait_s!r} is not a wait's time (a finite number in [0, {MAX_WAIT_S:g}] s, "
                         f"wait requests only)")
    if len(h.proof) > 64:
        raise FrameError(f"proof: {len(h.proof)} bytes, more than 64")
    return h


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def recv_exactly_into(sock: socket.socket, view: memoryview, deadline: float, hasher: Any = None) -> None:
    """Fill ``view`` from ``sock`` (``recv_into``, no copy); PeerClosedError at end of stream,
    TimeoutError once ``deadline`` passes. ``hasher`` (an ``xxhash.xxh3_64``): each piece is
    hashed as soon as it arrived, while it is still in the CPU cache."""
    got, n = 0, view.nbytes
    timeout = _left(deadline)
    sock.settimeout(timeout)
    while got < n:
        k = sock.recv_into(view[got:got + (RECV_PIECE_BYTES if hasher is None else HASH_PIECE_BYTES)])
        if k == 0:
            raise PeerClosedError(f"peer closed the stream after {got} of {n} bytes")
        if hasher is not None:
            hasher.update(view[got:got + k])
        got += k
        if got < n:
            # Re-arm the socket's timeout only when the deadline has moved in by more than
            # _RETIME_S (a settimeout per piece costs as much as a small recv).
            left = _left(deadline)
            if timeout - left > _RETIME_S:
                timeout = left
                sock.settimeout(timeout)


def wait_readable(sock: socket.socket, deadline: float) -> None:
    """Block until ``sock`` has a byte to read (or its end), TimeoutError once ``deadline`` passes.
    A server waits for a request's first byte with this, so the frame's own time
    (``frame_timeout_s``) starts when the frame does, not when the idle wait began."""
    pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted are not on the fd
    if pending is not None and pending():
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
    while not poller.poll(max(1, int(_left(deadline) * 1000) + 1)):
        pass


def read_header(sock: socket.socket, max_object_bytes: int, deadline: float,
                first_deadline: float | None = None, session: Session | None = None) -> Header:
    """Read, decode and validate one header. ``first_deadline`` bounds the wait for its first
    byte (an idle connection), ``deadline`` the rest. With ``session`` (every frame after the
    handshake) the header's tag is checked before it is decoded. PeerClosedError when the stream
    ends before or inside it; FrameError (TagError) for a bad one; TimeoutError."""
    prefix = bytearray(LEN.size)
    pv = memoryview(prefix)
    sock.settimeout(_left(deadline if first_deadline is None else first_deadline))
    k = sock.recv_into(pv)
    if k == 0:
        raise PeerClosedError("peer closed the connection")
    if k < LEN.size:
        recv_exactly_into(sock, pv[k:], deadline)
    (length,) = LEN.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise FrameError(f"header length {length} is larger than the {MAX_HEADER_BYTES}-byte limit")
    tag = TAG_BYTES if session is not None else 0
    body = bytearray(length + tag)
    recv_exactly_into(sock, memoryview(body), deadline)
    if session is not None:
        bv = memoryview(body)
        session.check(prefix + bv[:length], bv[length:])
        return validate(decode(bv[:length]), max_object_bytes)
    return validate(decode(body), max_object_bytes)


def send_header(sock: socket.socket, header: Header, deadline: float, session: Session | None = None) -> int:
    """Send one header (blocking, bounded by ``deadline``), tagged by ``session`` when given;
    returns its index in ``session`` (0 without one)."""
    data = encode(header)
    index = 0
    if session is not None:
        index = session.sent
        data = session.seal(data)
    sock.settimeout(_left(deadline))
    sock.sendall(data)
    return index


def send_view(sock: socket.socket, view: memoryview, deadline: float, hasher: Any = None) -> None:
    """Send ``view`` (no copy), bounded by ``deadline`` (checked between pieces). ``hasher`` (an
    ``xxhash.xxh3_64``): each piece is hashed just before it is sent, so the send reads it from
    the CPU cache."""
    sent, n = 0, view.nbytes
    timeout = _left(deadline)
    sock.settimeout(timeout)
    hashed = 0
    while sent < n:
        if hasher is not None and hashed == sent:
            hashed = min(n, sent + HASH_PIECE_BYTES)
            hasher.update(view[sent:hashed])
        sent += sock.send(view[sent:hashed if hasher is not None else sent + RECV_PIECE_BYTES])
        if sent < n:
            left = _left(deadline)
            if timeout - left > _RETIME_S:
                timeout = left
                sock.settimeout(timeout)
