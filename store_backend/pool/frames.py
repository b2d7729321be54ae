"""The pool transport's wire format: msgpack control headers and raw payloads on a TCP stream.

A frame is a 4-byte big-endian header length (at most :data:`MAX_HEADER_BYTES`), a msgspec msgpack
:class:`Header`, then, for the ops that carry objects, the objects' raw bytes back to back in the
order and sizes the header names. Exchanges (``req`` numbers a request; its answers repeat it):

- get: ``get`` (keys, sizes = the reader's buffer capacities, optionally checksums = what the
  reader will verify each object against, the directory's record; 0 = none) -> ``get_reply`` (statuses, sizes)
  -> the payload of every OK key -> ``get_ack`` from the reader once it has all of it ->
  ``get_end`` (statuses: OK, or IO_ERROR where the lease's release said the bytes may have
  changed while they were sent; checksums: xxh3-64 per OK key, 0 where the request named one:
  the reader checks those against its own record, so the server need not hash them). The server releases its leases
  only after ``get_ack``: ``sendfile`` queues references to the arena's pages, not copies, so a
  slot released (and reused) before the reader copied them out would change bytes in flight.
- put: ``put`` (keys, sizes) -> ``put_accept`` (statuses: OK = send it) -> the payload of every
  accepted key -> ``put_end`` (checksums of the sent keys) -> ``put_reply`` (statuses).
- remove: ``remove`` (keys) -> ``remove_reply`` (statuses).
- ``error`` (error text) answers anything the peer refuses; the connection is closed after it.
- Handshake (:mod:`store_backend.pool.auth`): ``auth_ok`` carries the server's proof.

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

OPS = ("get", "get_reply", "get_ack", "get_end", "put", "put_accept", "put_end", "put_reply", "remove", "remove_reply",
       "error", "auth_ok")
REQUEST_OPS = ("get", "put", "remove")
_STATUSES = frozenset(int(s) for s in Status)


class FrameError(ValueError):
    """Bytes that break the wire format (a length over the cap, an undecodable header, a field of
    the wrong type or count, a size out of range, an invalid key). The message names the field."""


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


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Header)


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
    if h.op == "get_reply" and len(h.sizes) != len(h.statuses):
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


def read_header(sock: socket.socket, max_object_bytes: int, deadline: float,
                first_deadline: float | None = None) -> Header:
    """Read, decode and validate one header. ``first_deadline`` bounds the wait for its first
    byte (an idle connection), ``deadline`` the rest. PeerClosedError when the stream ends before
    or inside it; FrameError for a bad one; TimeoutError."""
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
    body = bytearray(length)
    recv_exactly_into(sock, memoryview(body), deadline)
    return validate(decode(body), max_object_bytes)


def send_header(sock: socket.socket, header: Header, deadline: float) -> None:
    """Send one header (blocking, bounded by ``deadline``)."""
    data = encode(header)
    sock.settimeout(_left(deadline))
    sock.sendall(data)


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
