"""Prefix lookups answered by the process that owns the store, over a local Unix socket.

An engine's scheduler and its workers may live in different processes (vLLM's API server runs the
scheduler in the engine-core process and each worker in its own). The embedded store lives with the
worker, which saves and loads the bytes; the scheduler must still learn which chunks that store
holds, and lease them until the worker loads them. :class:`LookupServer` (owned by the worker half)
answers ``exists``/``pin``/``unpin`` against its store; :class:`LookupClient` (used by the scheduler
half) asks. When both halves share a process the same socket is used, so there is one code path.

Wire format: a 4-byte little-endian length, then a msgpack :class:`Request` or :class:`Reply`.
The server runs one accept thread and one thread per connection (the scheduler keeps one), all
owned by the server: ``start()`` creates them, ``close()`` stops them. The socket file is created
with mode 0600 (same user only) and removed on close.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec
import xxhash

logger = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class PrefixIndex(Protocol):
    """What the server answers from: a store, or a KVClient (which also counts saves in flight)."""

    def exists(self, keys: Sequence[str]) -> int: ...

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]: ...

    def unpin(self, keys: Sequence[str]) -> None: ...


class Request(msgspec.Struct, array_like=True):
    op: Literal["exists", "pin", "unpin"]
    keys: list[str]
    ttl_s: float = 0.0


class Reply(msgspec.Struct, array_like=True):
    count: int = 0  # exists: leading keys present
    present: list[bool] = msgspec.field(default_factory=list)  # pin: presence per key
    error: str | None = None


# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


def socket_path(engine_id: str, shard_index: int, directory: str | None = None) -> str:
    """Where the lookup server of one engine's shard listens. The engine id is hashed so the name
    stays short; raises ValueError naming ``lookup_socket_dir`` when the directory is too long for
    an AF_UNIX address."""
    path = os.path.join(directory or tempfile.gettempdir(),
                        f"mooncake-kv-{xxhash.xxh64_hexdigest(engine_id.encode())}-{shard_index}.sock")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"lookup socket path {path!r} is longer than an AF_UNIX address allows "
                         f"({MAX_SOCKET_PATH_BYTES} bytes): set lookup_socket_dir to a shorter directory")
    return path


def _remove_stale_sockets(directory: str) -> None:
    """Unlink lookup sockets nobody listens on any more (engines killed before they could close)."""
    for path in glob.glob(os.path.join(directory, "mooncake-kv-*.sock")):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.2)
            probe.connect(path)
        except ConnectionRefusedError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:
            pass  # not ours to judge (permissions, a busy listener)
        finally:
            probe.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {n} bytes is larger than {MAX_MESSAGE_BYTES}")
    return _recv_exact(sock, n)


class LookupServer:
    """Answers lookups and leases against ``store`` on a Unix socket at ``path``."""

    def __init__(self, store: PrefixIndex, path: str) -> None:
        self.store = store
        self.path = path
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def start(self) -> LookupServer:
        if self._sock is not None:
            return self
        _remove_stale_sockets(os.path.dirname(self.path))
        if os.path.exists(self.path):
            os.unlink(self.path)  # left by an engine that died; engine ids are unique per start
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        sock.listen(8)
        self._sock = sock
        t = threading.Thread(target=self._accept_loop, name="kv-lookup-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def close(self) -> None:
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                t = threading.Thread(target=self._serve, args=(conn,), name="kv-lookup-conn", daemon=True)
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        decoder = msgspec.msgpack.Decoder(Request)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                raw = _recv(conn)
                if raw is None:
                    return
                try:
                    reply = self._handle(decoder.decode(raw))
                except Exception as e:  # a bad request answers an error; the connection stays up
                    logger.exception("lookup request failed")
                    reply = Reply(error=f"{type(e).__name__}: {e}")
                _send(conn, encoder.encode(reply))
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, req: Request) -> Reply:
        if req.op == "exists":
            return Reply(count=self.store.exists(req.keys) if req.keys else 0)
        if req.op == "pin":
            return Reply(present=self.store.pin(req.keys, ttl_s=req.ttl_s) if req.keys else [])
        self.store.unpin(req.keys)
        return Reply()


class LookupClient:
    """Asks a :class:`LookupServer`. Blocking, thread-safe (one request at a time per client).

    Any transport failure (server not up yet, engine shutting down) answers "nothing present":
    a lookup that cannot be answered is a miss, never an error in the scheduler.
    """

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self.failures = 0

    def _call(self, req: Request) -> Reply | None:
        with self._lock:
            for attempt in range(2):  # one reconnect: the server may have restarted
                try:
                    if self._sock is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.settimeout(self.timeout_s)
                        sock.connect(self.path)
                        self._sock = sock
                    _send(self._sock, self._encoder.encode(req))
                    raw = _recv(self._sock)
                    if raw is None:
                        raise ConnectionError("lookup server closed the connection")
                    reply = self._decoder.decode(raw)
                    if reply.error:
                        logger.warning("lookup server error: %s", reply.error)
                        return None
                    return reply
                except (OSError, ValueError) as e:
                    self._drop()
                    if attempt:
                        self.failures += 1
                        logger.debug("lookup at %s failed: %s", self.path, e)
            return None

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def exists(self, keys: Sequence[str]) -> int:
        reply = self._call(Request("exists", list(keys)))
        return 0 if reply is None else reply.count

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]:
        reply = self._call(Request("pin", list(keys), ttl_s))
        return [False] * len(keys) if reply is None else reply.present

    def unpin(self, keys: Sequence[str]) -> None:
        self._call(Request("unpin", list(keys)))

    def close(self) -> None:
        with self._lock:
            self._drop()
