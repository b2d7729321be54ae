"""Shared pieces of the transport tests: a served store, a server in its own process, payloads
that verify themselves, and a byte-flipping TCP proxy (fault injection)."""

from __future__ import annotations

import abc
import hashlib
import multiprocessing
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_server import TcpTransportServer
from store_backend.store import TieredStore

MiB = 1 << 20
SECRET = "test-pool-secret"


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic bytes for a key, so any reader can check what it got."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def make_store(capacity_bytes: int = 64 * MiB, shared: bool = True) -> TieredStore:
    """A real TieredStore; ``shared``: its arena is a fresh /dev/shm segment (sendfile applies)."""
    dram: dict[str, Any] = {"capacity_bytes": capacity_bytes}
    if shared:
        dram["shm_name"] = f"mkv-test-{uuid.uuid4().hex[:12]}"
    return TieredStore({"dram": dram}, fresh_segment=shared)


@contextmanager
def served(capacity_bytes: int = 64 * MiB, shared: bool = True, **server_kw: Any
           ) -> Iterator[tuple[TieredStore, TcpTransportServer]]:
    store = make_store(capacity_bytes, shared)
    server = TcpTransportServer(store, SECRET, **server_kw)
    try:
        server.start()
        yield store, server
    finally:
        server.close()
        store.close(flush=False)


def _serve_process(q: Any, stop: Any, capacity_bytes: int, keys_sizes: list[tuple[str, int]]) -> None:
    store = make_store(capacity_bytes)
    st = store.put([k for k, _ in keys_sizes], [payload(k, s) for k, s in keys_sizes])
    assert all(s.ok for s in st), st
    server = TcpTransportServer(store, SECRET)
    server.start()
    q.put(server.address)
    stop.poll(120)  # the parent sends a byte or closes its end (a pipe: a SIGKILLed waiter cannot wedge it)
    server.close()
    store.close(flush=False)


class ServerProcess:
    """A TcpTransportServer over a real TieredStore in its own (spawned) process, preloaded with
    ``payload(key, size)`` for each of ``keys_sizes``. ``kill()`` is SIGKILL."""

    def __init__(self, keys_sizes: list[tuple[str, int]], capacity_bytes: int = 128 * MiB) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._q = ctx.Queue()
        stop_r, self._stop = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_serve_process, args=(self._q, stop_r, capacity_bytes, keys_sizes),
                                daemon=True)
        self.proc.start()
        stop_r.close()
        self.address: str = self._q.get(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        try:
            self._stop.send_bytes(b"x")
        except OSError:
            pass
        self._stop.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class _Relay(abc.ABC):
    """A listener on 127.0.0.1 in front of ``upstream``: each connection accepted is paired with a new
    one to ``upstream`` and handed to :meth:`_relay`. A subclass sets its own fields, then calls
    :meth:`_start`. Owned threads; ``close()`` ends them."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._up = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []

    def _start(self) -> None:
        self._spawn(self._accept)

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            s = socket.create_connection(self._up)
            self._socks += [c, s]
            self._relay(c, s)

    @abc.abstractmethod
    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        """Start the pumps between one accepted client and its upstream connection."""

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(5)


class FlipProxy(_Relay):
    """A TCP proxy in front of ``upstream`` that flips (XOR 0xFF) the byte at stream offset
    ``flip_at`` of one direction (``"down"``: server to client, ``"up"``: client to server) of
    every connection. Owned threads; ``close()`` ends them."""

    def __init__(self, upstream: str, flip_at: int, direction: str) -> None:
        super().__init__(upstream)
        self._flip_at, self._dir = flip_at, direction
        self.flipped = 0
        self._start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        for src, dst, d in ((server, client, "down"), (client, server, "up")):
            self._spawn(self._pump, src, dst, d == self._dir)

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if flip and seen <= self._flip_at < seen + len(data):
                    b = bytearray(data)
                    b[self._flip_at - seen] ^= 0xFF
                    data = bytes(b)
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(src, dst)


def tls_round_trip(t: TcpTransport, srv: TcpTransportServer, prefix: str) -> list[str]:
    """Put three ~1 MiB objects through ``t`` into ``srv`` and read them back byte for byte over
    TLS (no sendfile: it would bypass TLS); returns their keys."""
    from store_backend.types import ReadResult, Status

    keys = [f"{prefix}/{i}" for i in range(3)]
    data = [payload(k, 1 * MiB + i) for i, k in enumerate(keys)]
    assert t.put(srv.address, keys, data) == [Status.OK] * 3
    outs = [np.zeros(d.nbytes, np.uint8) for d in data]
    assert t.get_into(srv.address, keys, outs) == [ReadResult(Status.OK, d.nbytes) for d in data]
    assert all(np.array_equal(o, d) for o, d in zip(outs, data))
    assert srv.stats()["sendfile_bytes"] == 0
    return keys


def wait_for(cond: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)  # poll interval; the loop has a deadline
    return bool(cond())


def slots_held(store: TieredStore) -> tuple[int, int]:
    g = store.stats().slots
    return g.reservations, g.leases


def transport(**kw: Any) -> TcpTransport:
    return TcpTransport(SECRET, **kw)



def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError(f"stream ended after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


class SwapRelay(_Relay):
    """An on-path relay that does NOT know the secret (fault injection: an attacker). It passes the
    handshake through untouched, then, on the first connection, replaces the payload of the first
    ``op`` ("put": client to server, "get": server to client) with ``EVIL...`` bytes of the same
    size, and with ``rewrite_end`` also rewrites the end frame's checksums (put_end / get_end) to
    the plain xxh3-64 of its bytes, keeping the frame's tag (it cannot compute a new one).
    Everything else is relayed as is. Owned threads; ``close()`` ends them."""

    def __init__(self, upstream: str, op: str, rewrite_end: bool, tag_bytes: int) -> None:
        super().__init__(upstream)
        self._op, self._rewrite, self._tag = op, rewrite_end, tag_bytes
        self.swapped = 0
        self.errors: list[BaseException] = []
        self._first = True
        self._start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        first, self._first = self._first, False
        self._spawn(self._up_pump, client, server, first)
        self._spawn(self._down_pump, server, client, first)

    def _frame(self, src: socket.socket, tagged: bool = True) -> tuple[bytes, bytes, bytes]:
        from store_backend.pool.frames import LEN
        prefix = _exactly(src, 4)
        (n,) = LEN.unpack(prefix)
        return prefix, _exactly(src, n), _exactly(src, self._tag) if tagged else b""

    def _end(self, src: socket.socket, dst: socket.socket, evil: list[bytes]) -> None:
        import xxhash

        from store_backend.pool.frames import decode, encode
        prefix, body, tag = self._frame(src)
        if self._rewrite:
            h = decode(body)
            h.checksums = [xxhash.xxh3_64_intdigest(e) for e in evil]
            dst.sendall(encode(h) + tag)
        else:
            dst.sendall(prefix + body + tag)

    @staticmethod
    def _evil(size: int) -> bytes:
        return (b"EVIL" * (size // 4 + 1))[:size]

    def _up_pump(self, src: socket.socket, dst: socket.socket, first: bool) -> None:
        from store_backend.pool.frames import decode
        try:
            if first:
                dst.sendall(_exactly(src, 64))  # the client's nonce and proof, untouched
                if self._op == "put":
                    prefix, body, tag = self._frame(src)
                    dst.sendall(prefix + body + tag)
                    evil = []
                    for size in decode(body).sizes:
                        _exactly(src, size)
                        evil.append(self._evil(size))
                        dst.sendall(evil[-1])
                        self.swapped += 1
                    self._end(src, dst, evil)
            self._pass(src, dst)
        except (OSError, EOFError) as e:
            self.errors.append(e)
        finally:
            self._shut(src, dst)

    def _down_pump(self, src: socket.socket, dst: socket.socket, first: bool) -> None:
        from store_backend.pool.frames import decode
        try:
            if first:
                dst.sendall(_exactly(src, 5 + 32))  # greeting: magic and nonce
                prefix, body, tag = self._frame(src, tagged=False)  # auth_ok
                dst.sendall(prefix + body + tag)
                if self._op == "get":
                    prefix, body, tag = self._frame(src)
                    dst.sendall(prefix + body + tag)
                    reply = decode(body)
                    evil = []
                    for st, size in zip(reply.statuses, reply.sizes):
                        if st == 0:
                            _exactly(src, size)
                            evil.append(self._evil(size))
                            dst.sendall(evil[-1])
                            self.swapped += 1
                    self._end(src, dst, evil)
            self._pass(src, dst)
        except (OSError, EOFError) as e:
            self.errors.append(e)
        finally:
            self._shut(src, dst)

    @staticmethod
    def _pass(src: socket.socket, dst: socket.socket) -> None:
        while True:
            data = src.recv(1 << 16)
            if not data:
                return
            dst.sendall(data)


__all__ = ["MiB", "SECRET", "FlipProxy", "ServerProcess", "SwapRelay", "make_store", "payload", "served", "slots_held",
           "transport", "wait_for"]
