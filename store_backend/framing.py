"""Length-prefixed frames on a local stream socket: the wire format every control socket shares.

A frame is a 4-byte little-endian body length, then the body (msgpack, decoded by the protocol that
uses it). A frame's body is at most :data:`MAX_FRAME_BYTES` unless a caller names a smaller cap.
Used by :mod:`mooncake_connector.lookup_service` (blocking, a thread per connection) and by the node
service's control protocol (:mod:`store_backend.node.protocol`; :class:`FrameDecoder` is the sans-I/O
half an asyncio server feeds, :func:`read_frame` the blocking half a client or test reads with).

A peer is trusted no further than it must be: a length over the cap is refused as soon as its four
bytes arrive, and a body is buffered as it arrives (an announced length is never allocated up front),
so a peer that announces much and sends little costs only what it sent. Nothing here is thread-safe:
one reader and one writer per socket at a time.
"""

from __future__ import annotations

import socket
import struct
import time

LEN = struct.Struct("<I")
HEADER_BYTES = LEN.size
# Largest frame either side sends or accepts. 8 MiB holds an exists/pin request of ~100k keys
# (a million-token prompt in 16-token chunks); clients split anything larger.
MAX_FRAME_BYTES = 8 * 1024 * 1024
# A body is read in pieces of at most this, so memory follows the bytes that actually arrived.
READ_PIECE_BYTES = 256 * 1024


class FrameError(ValueError):
    """Bytes that break the wire format: a length over the cap, a stream that ends inside a frame,
    a body the protocol cannot decode. The message says which, with the sizes involved."""


class FrameTooLargeError(FrameError):
    """A frame whose length is over the cap (a service answers ``error(too_large)``)."""


class FrameTimeoutError(TimeoutError):
    """A frame that did not arrive completely before its deadline (the message says how much did)."""


def frame(payload: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``payload`` with its length prefix; FrameError when it is over ``max_frame_bytes``."""
    if len(payload) > max_frame_bytes:
        raise FrameTooLargeError(f"a frame of {len(payload)} bytes is larger than the {max_frame_bytes}-byte limit")
    return LEN.pack(len(payload)) + payload


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one frame (blocking; the socket's own timeout applies)."""
    sock.sendall(LEN.pack(len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """``n`` bytes, read in bounded pieces; None at end of stream. With ``deadline`` (monotonic),
    TimeoutError once it passes, however the bytes trickle in; without, the socket's own timeout
    applies per piece."""
    pieces: list[bytes] = []
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameTimeoutError(f"frame deadline passed with {got} of {n} bytes read")
            sock.settimeout(left)
        piece = sock.recv(min(n - got, READ_PIECE_BYTES))
        if not piece:
            return None
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def recv_frame(sock: socket.socket, first: bytes = b"", deadline: float | None = None,
               max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """One frame's body; None when the peer closed the stream (also inside a frame). FrameError
    for a length over the cap. ``first``: the frame's bytes already read; ``deadline``: see
    :func:`recv_exact`."""
    rest = recv_exact(sock, HEADER_BYTES - len(first), deadline)
    if rest is None:
        return None
    (n,) = LEN.unpack(first + rest)
    if n > max_frame_bytes:
        raise FrameTooLargeError(f"a frame of {n} bytes is larger than the {max_frame_bytes}-byte limit")
    return recv_exact(sock, n, deadline)


class FrameDecoder:
    """Splits a byte stream into frame bodies as the bytes arrive (sans-I/O: it never touches a socket).

    ``feed(data)`` returns the bodies completed by ``data``, in order. After it returns, at most
    ``HEADER_BYTES + max_frame_bytes`` bytes are buffered: a length over the cap raises
    :class:`FrameError` as soon as its four bytes are in, before any of its body is kept. After a
    FrameError the stream cannot be resynchronised: every later ``feed`` raises it again (the owner
    closes the connection). One decoder per connection; not thread-safe.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be > 0, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None  # the current frame's body length, once its header is in
        self._broken: FrameError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for frames not complete yet."""
        return len(self._buf)

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived (an end of stream now would cut it)."""
        return bool(self._buf) or self._need is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        if self._broken is not None:
            raise FrameError(f"the stream broke earlier ({self._broken})")
        self._buf += data
        bodies: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER_BYTES:
                    return bodies
                (n,) = LEN.unpack_from(self._buf)
                if n > self.max_frame_bytes:
                    self._buf = bytearray()
                    self._broken = FrameTooLargeError(
                        f"a frame of {n} bytes is larger than the {self.max_frame_bytes}-byte limit")
                    raise self._broken
                del self._buf[:HEADER_BYTES]
                self._need = n
            if len(self._buf) < self._need:
                return bodies
            bodies.append(bytes(self._buf[:self._need]))
            del self._buf[:self._need]
            self._need = None

    def eof(self) -> None:
        """The stream ended: FrameError when it ended inside a frame (the bytes are dropped)."""
        if self._broken is None and self.mid_frame:
            got = len(self._buf) + (HEADER_BYTES if self._need is not None else 0)
            whole = f"a {HEADER_BYTES + self._need}-byte frame" if self._need is not None else "a frame header"
            self._buf = bytearray()
            self._need = None
            self._broken = FrameError(f"the stream ended {got} bytes into {whole}")
            raise self._broken


def read_frame(sock: socket.socket, decoder: FrameDecoder, pending: list[bytes],
               deadline: float | None = None) -> bytes | None:
    """The next frame body from ``sock`` (blocking); None at a clean end of stream (between frames).

    ``pending`` holds bodies that arrived ahead of the one asked for (a read may bring several);
    pass the same list, and the same ``decoder``, for every read of one connection. With
    ``deadline`` (monotonic) the frame must complete before it: :class:`FrameTimeoutError` names how
    much had arrived. FrameError for a length over the cap or a stream that ends inside a frame.
    """
    while not pending:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameTimeoutError(
                    f"frame deadline passed with {decoder.buffered_bytes} bytes of the frame read")
            sock.settimeout(left)
        try:
            data = sock.recv(READ_PIECE_BYTES)
        except TimeoutError:
            if deadline is None:
                raise
            continue  # the loop's deadline check names what arrived
        if not data:
            decoder.eof()
            return None
        pending.extend(decoder.feed(data))
    return pending.pop(0)
