"""Mutual shared-secret authentication of a pool transport connection (HMAC-SHA256 both ways).

1. server -> client: ``MKVP3`` + a 32-byte random nonce ``ns``;
2. client -> server: its own 32-byte nonce ``nc`` + HMAC(secret, ``b"c" + ns + nc``);
3. server checks it (``hmac.compare_digest``) and answers an ``auth_ok`` header whose ``proof`` is
   HMAC(secret, ``b"s" + nc + ns``), which the client checks; or an ``error`` header, then closes
   (a wrong proof, or a proven peer the server has no room for: ``admit``).

Both sides then hold the connection's :class:`~store_backend.pool.frames.Session`, keyed
HMAC(secret, ``b"k" + ns + nc``): every later frame is tagged and every payload checksum keyed
with it. Neither side learns anything of the secret from a failed attempt, and a recorded exchange
cannot be replayed (both nonces are fresh). Both functions block, bounded by their deadline, and
raise :class:`AuthError` (a refusal) or the socket's own errors (TimeoutError, ConnectionError).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time
from collections.abc import Callable

from store_backend.pool.frames import (LEN, MAX_HEADER_BYTES, FrameError, Header, PeerClosedError, Session, decode,
                                       read_header, recv_exactly_into, send_header)

# The wire format's version: 2 tagged every frame after the handshake; 3 adds a remove's before_s
# (a peer of another version fails here, with an error that names both).
MAGIC = b"MKVP3"
NONCE_BYTES = 32
MAC_BYTES = 32


class AuthError(ConnectionError):
    """The peer did not prove the shared secret (or refused ours); the message says which side."""


class RefusedError(ConnectionError):
    """The server refused the connection before authentication (e.g. it serves too many)."""


def secret_bytes(secret: str | bytes) -> bytes:
    """The secret as bytes; ValueError for an empty one (it would authenticate anybody)."""
    b = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if not b:
        raise ValueError("secret: an empty shared secret is refused")
    return b


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def session_key(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    """The connection's key, from both nonces (fresh on both sides: a new key per connection)."""
    return _mac(secret, b"k", ns, nc)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float,
                     admit: Callable[[], str | None] | None = None) -> Session:
    """Prove the connecting peer knows ``secret`` and prove it back; returns the connection's
    session. AuthError (after sending an ``error`` header) when it does not. ``admit`` (called
    once the peer's proof checked out, so an unauthenticated peer never reaches it) returns None
    to let it in, or why not: then an ``error`` header with that text and RefusedError."""
    ns = secrets.token_bytes(NONCE_BYTES)
    send_header_raw(sock, MAGIC + ns, deadline)
    got = bytearray(NONCE_BYTES + MAC_BYTES)
    recv_exactly_into(sock, memoryview(got), deadline)
    nc, mac = bytes(got[:NONCE_BYTES]), bytes(got[NONCE_BYTES:])
    if not hmac.compare_digest(mac, _mac(secret, b"c", ns, nc)):
        try:
            send_header(sock, Header(op="error", error="authentication failed: wrong shared secret"), deadline)
        except OSError:
            pass
        raise AuthError("the peer's proof of the shared secret is wrong")
    why = admit() if admit is not None else None
    if why is not None:
        refuse(sock, why, deadline)
        raise RefusedError(why)
    send_header(sock, Header(op="auth_ok", proof=_mac(secret, b"s", nc, ns)), deadline)
    return Session(session_key(secret, ns, nc), is_server=True)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> Session:
    """Prove ``secret`` to the server and check its proof; returns the connection's session.
    AuthError when either fails (or the server speaks another protocol, or refused us)."""
    hello = bytearray(len(MAGIC) + NONCE_BYTES)
    try:
        recv_exactly_into(sock, memoryview(hello)[:len(MAGIC)], deadline)
        if bytes(hello[:len(MAGIC)]) != MAGIC:
            _raise_refusal(sock, bytes(hello[:len(MAGIC)]), deadline)
        recv_exactly_into(sock, memoryview(hello)[len(MAGIC):], deadline)
    except PeerClosedError as e:
        raise PeerClosedError(f"the server closed the connection before its greeting: {e}") from None
    ns = bytes(hello[len(MAGIC):])
    nc = secrets.token_bytes(NONCE_BYTES)
    send_header_raw(sock, nc + _mac(secret, b"c", ns, nc), deadline)
    try:
        reply = read_header(sock, 0, deadline)
    except PeerClosedError:
        raise AuthError("the server closed the connection during authentication") from None
    if reply.op == "error":
        raise AuthError(f"the server refused the connection: {reply.error}")
    if reply.op != "auth_ok" or not hmac.compare_digest(reply.proof, _mac(secret, b"s", nc, ns)):
        raise AuthError("the server's proof of the shared secret is wrong")
    return Session(session_key(secret, ns, nc), is_server=False)


def refuse(sock: socket.socket, why: str, deadline: float) -> None:
    """Refuse a connection (before the greeting, or after the peer's proof): one untagged
    ``error`` header (best effort)."""
    try:
        send_header(sock, Header(op="error", error=why), deadline)
    except OSError:
        pass


def _raise_refusal(sock: socket.socket, first: bytes, deadline: float) -> None:
    """The greeting was not ``MAGIC``: an ``error`` header (:func:`refuse`) raises RefusedError
    with its text, anything else AuthError (another protocol)."""
    if first[:len(MAGIC) - 1] == MAGIC[:-1]:
        raise AuthError(f"the server speaks the pool's wire version {first[len(MAGIC) - 1:]!r}, this node "
                        f"{MAGIC[len(MAGIC) - 1:]!r}: run the same mooncake-kv release on every node")
    (length,) = LEN.unpack(first[:LEN.size])
    if length > MAX_HEADER_BYTES:
        raise AuthError(f"the server's greeting starts {first!r}, not {MAGIC!r}: another protocol")
    body = bytearray(length)
    body[:1] = first[LEN.size:]
    recv_exactly_into(sock, memoryview(body)[1:], deadline)
    try:
        h = decode(body)
    except FrameError:
        raise AuthError(f"the server's greeting starts {first!r}, not {MAGIC!r}: another protocol") from None
    raise RefusedError(f"the server refused the connection: {h.error or h.op}")


def send_header_raw(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send raw handshake bytes, bounded by ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    sock.sendall(data)
