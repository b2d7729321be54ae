"""The TCP pool transport's client: :class:`TcpTransport` reads from and writes to
:class:`~store_backend.pool.tcp_server.TcpTransportServer` peers (the wire format of
:mod:`store_backend.pool.frames`, authenticated by :mod:`store_backend.pool.auth`; what both ends
share, :mod:`store_backend.pool.tcp_common`).

Client: a bounded pool of authenticated connections per peer, reused across calls; a connection
that failed in any way is closed, never reused. A batch is split by bytes over up to ``streams``
connections run in parallel (the caller's thread runs one, the transport's owned workers the
rest). Objects are received with ``recv_into`` straight into the caller's buffers.

Frames, checksums and deadlines: :mod:`store_backend.pool.tcp_common`.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from store_backend.pool.auth import AuthError, RefusedError, client_handshake, secret_bytes
from store_backend.pool.frames import (MAX_U64, MAX_WAIT_S, FrameError, Header, PeerClosedError, Session, read_header,
                                       recv_exactly_into, send_header, send_view)
from store_backend.pool.tcp_common import (DEFAULT_SOCKET_BUFFER_BYTES, KEYS_PER_FRAME, MIN_STREAM_BYTES, auto_streams,
                                           parse_address, split_by_bytes, time_left, tune_socket)
from store_backend.pool.transport import FAILURE_KINDS, FailureKind
from store_backend.threads import Deadline, shutdown_pool
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_batch, check_key

logger = logging.getLogger(__name__)


# -- client ---------------------------------------------------------------------------------------

class _Failure(Exception):
    """One exchange with a peer failed; ``kind`` is a FAILURE_KINDS entry."""

    def __init__(self, kind: FailureKind, why: str, before_reply: bool = False) -> None:
        super().__init__(why)
        self.kind = kind
        self.before_reply = before_reply


def _classify(e: BaseException) -> FailureKind:
    if isinstance(e, _Failure):
        return e.kind
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, (AuthError, RefusedError, ssl.SSLError)):  # TLS: a certificate refused, either way
        return "refused"
    if isinstance(e, FrameError):
        return "protocol"
    return "peer_gone"


class _Conn:
    __slots__ = ("sock", "address", "reused", "session")

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.reused = False
        self.session: Session = Session(b"", False)  # replaced by the handshake's


class TcpTransport:
    """Client of :class:`TcpTransportServer` peers (implements
    :class:`~store_backend.pool.transport.Transport`). Thread-safe; ``close()`` ends it."""

    def __init__(self, secret: str | bytes, *, streams: int | None = None, max_idle_per_peer: int | None = None,
                 socket_buffer_bytes: int = DEFAULT_SOCKET_BUFFER_BYTES, workers: int = 8,
                 min_stream_bytes: int = MIN_STREAM_BYTES, max_object_bytes: int = MAX_U64,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``streams``: connections one batch is split over (default :func:`auto_streams`);
        ``max_idle_per_peer`` (default
        ``2 * streams``): idle connections kept per peer; ``workers``: owned threads running the
        extra streams of every call. ``ssl_context`` (a client-side ``ssl.SSLContext``, e.g.
        ``ssl.create_default_context(cafile=...)``): every connection is TLS, the server's
        certificate checked for the address's host name (when the context checks host names)."""
        if streams is None:
            streams = auto_streams()
        for name, v in (("streams", streams), ("workers", workers)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self._secret = secret_bytes(secret)
        self.streams = streams
        self.max_idle_per_peer = 2 * streams if max_idle_per_peer is None else max_idle_per_peer
        self._buffer_bytes = socket_buffer_bytes
        self._min_stream_bytes = min_stream_bytes
        self._max_object_bytes = max_object_bytes
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = {}
        self._live: set[_Conn] = set()
        self._closed = False
        self._req = itertools.count(1)
        self._stats = dict.fromkeys(("bytes_received", "bytes_sent", "requests", "connections",
                                     *(f"failures_{k}" for k in FAILURE_KINDS)), 0)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="mkv-pool-stream")

    # -- bookkeeping ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``bytes_received``, ``bytes_sent``, ``requests``, ``connections`` (opened) and
        ``failures_<kind>``: keys that failed for that reason (a checksum: per mismatching key)."""
        with self._lock:
            return dict(self._stats)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def close(self) -> None:
        """Close every connection (idempotent); calls in flight fail with IO_ERROR."""
        with self._lock:
            self._closed = True
            conns = list(self._live)
            self._idle.clear()
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = Deadline(5.0)
        shutdown_pool(self._workers, deadline, owner="pool transport")
        for c in conns:
            c.sock.close()

    def _checkout(self, address: str, deadline: float) -> _Conn:
        with self._lock:
            if self._closed:
                raise _Failure("peer_gone", "the transport is closed", before_reply=True)
            idle = self._idle.get(address)
            if idle:
                conn = idle.pop()
                conn.reused = True
                return conn
        host, port = parse_address(address)
        sock = socket.create_connection((host, port), timeout=time_left(deadline))
        if self._ssl is not None:
            try:
                sock = self._ssl.wrap_socket(sock, server_hostname=host)  # TLS handshake, within the deadline
            except BaseException:
                sock.close()
                raise
        conn = _Conn(sock, address)
        with self._lock:
            self._live.add(conn)
            self._stats["connections"] += 1
        try:
            tune_socket(sock, self._buffer_bytes)
            conn.session = client_handshake(sock, self._secret, deadline)
        except BaseException:
            self._discard(conn)
            raise
        return conn

    def _checkin(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and conn in self._live:
                idle = self._idle.setdefault(conn.address, [])
                if len(idle) < self.max_idle_per_peer:
                    idle.append(conn)
                    return
            self._live.discard(conn)
        conn.sock.close()

    def _discard(self, conn: _Conn) -> None:
        with self._lock:
            self._live.discard(conn)
        conn.sock.close()

    def _run_split(self, todo: list[int], views: list[memoryview], run_part: Callable[[list[int]], None]) -> None:
        """``run_part(idx)`` for the indexes ``todo`` split into frames of at most KEYS_PER_FRAME keys,
        each frame split by bytes over the streams; the parts run as :meth:`_run_parts` runs them."""
        parts: list[Callable[[], None]] = []
        for at in range(0, len(todo), KEYS_PER_FRAME):
            chunk = todo[at:at + KEYS_PER_FRAME]
            for r in split_by_bytes([views[i].nbytes for i in chunk], self.streams, self._min_stream_bytes):
                idx = [chunk[j] for j in r]
                parts.append(lambda idx=idx: run_part(idx))
        self._run_parts(parts)

    def _run_parts(self, parts: list[Callable[[], None]]) -> None:
        """Run ``parts`` in parallel (the first on this thread) and wait for all of them: each is
        bounded by the call's deadline, and none may touch a caller's buffer after this returns."""
        futures: list[Future[None]] = []
        inline = parts[:1]
        for i, p in enumerate(parts[1:], 1):
            try:
                futures.append(self._workers.submit(p))
            except RuntimeError:  # closed: what is left runs here and fails at checkout (IO_ERROR)
                inline += parts[i:]
                break
        try:
            for p in inline:
                p()
        finally:
            for f in futures:
                f.result()

    def _exchange(self, address: str, deadline: float, body: Callable[[_Conn], None]) -> None:
        """Run ``body`` on a pooled connection; a pooled connection that turns out dead before any
        reply (the peer restarted) is retried once on a fresh one. Raises on failure (the
        connection is closed)."""
        for attempt in range(2):
            conn = None
            try:
                conn = self._checkout(address, deadline)
                body(conn)
            except BaseException as e:
                if conn is not None:
                    self._discard(conn)
                retry = (attempt == 0 and conn is not None and conn.reused and isinstance(e, _Failure)
                         and e.before_reply and e.kind == "peer_gone")
                if not retry:
                    raise
                continue
            self._checkin(conn)
            return

    @staticmethod
    def _first_reply(conn: _Conn, max_object_bytes: int, deadline: float, op: str, req: int) -> Header:
        try:
            h = read_header(conn.sock, max_object_bytes, deadline, session=conn.session)
        except (PeerClosedError, ConnectionResetError, BrokenPipeError) as e:
            raise _Failure("peer_gone", f"{conn.address}: {e}", before_reply=True) from None
        return TcpTransport._expect(h, op, req, conn.address)

    @staticmethod
    def _expect(h: Header, op: str, req: int, address: str) -> Header:
        if h.op == "error":
            raise _Failure("refused", f"{address} refused the request: {h.error}")
        if h.op != op or h.req != req:
            raise _Failure("protocol", f"{address}: expected {op} of request {req}, got {h.op} of request {h.req}")
        return h

    @staticmethod
    def _send_request(conn: _Conn, h: Header, deadline: float) -> None:
        try:
            send_header(conn.sock, h, deadline, conn.session)
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _Failure("peer_gone", f"{conn.address}: {e}", before_reply=True) from None

    def _fail(self, e: BaseException, address: str, op: str, n_keys: int) -> None:
        kind = _classify(e)
        self._count(f"failures_{kind}", n_keys)
        logger.warning("pool transport: %s of %d keys from %s failed (%s): %s", op, n_keys, address, kind, e)

    # -- get --------------------------------------------------------------------------------------
    def get_into(self, address: str, keys: Sequence[str], buffers: Sequence[Buffer], *,
                 checksums: Sequence[int] | None = None, timeout_s: float = 10.0) -> list[ReadResult]:
        """See :meth:`store_backend.pool.transport.Transport.get_into`. A read-only buffer is
        TypeError before anything is sent. Keys with ``checksums[i]`` != 0 are verified against it
        alone and the server does not hash them (the record covers the bytes end to end)."""
        check_batch(keys, buffers)
        if checksums is not None:
            if len(checksums) != len(keys):
                raise ValueError(f"got {len(keys)} keys but {len(checksums)} checksums")
            for i, c in enumerate(checksums):
                if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= MAX_U64:
                    raise ValueError(f"checksums[{i}] must be a 64-bit unsigned int (0: none), got {c!r}")
        parse_address(address)
        views = [byte_view(b) for b in buffers]
        for i, v in enumerate(views):
            if v.readonly:
                raise TypeError(f"buffers[{i}] is read-only")
        deadline = time.monotonic() + timeout_s
        results: list[ReadResult] = [ReadResult(Status.IO_ERROR)] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            if check_key(k) is not None:
                results[i] = ReadResult(Status.INVALID_KEY)
            else:
                todo.append(i)
        self._run_split(todo, views, lambda idx: self._get_part(address, idx, keys, views, checksums, deadline,
                                                                results))
        return results

    def _get_part(self, address: str, idx: list[int], keys: Sequence[str], views: list[memoryview],
                  checksums: Sequence[int] | None, deadline: float, results: list[ReadResult]) -> None:
        done: set[int] = set()

        def body(conn: _Conn) -> None:
            req = next(self._req) & MAX_U64
            self._count("requests")
            self._send_request(conn, Header(op="get", req=req, keys=[keys[i] for i in idx],
                                            sizes=[views[i].nbytes for i in idx],
                                            checksums=[] if checksums is None else [checksums[i] for i in idx]),
                               deadline)
            reply = self._first_reply(conn, self._max_object_bytes, deadline, "get_reply", req)
            if len(reply.statuses) != len(idx):
                raise _Failure("protocol", f"{address}: get_reply has {len(reply.statuses)} statuses for {len(idx)} keys")
            incoming: list[tuple[int, int]] = []
            for i, st, size in zip(idx, reply.statuses, reply.sizes):
                status = Status(st)
                if status is Status.OK:
                    if size > views[i].nbytes:
                        raise _Failure("protocol", f"{address}: {size} bytes for a buffer of {views[i].nbytes}")
                    incoming.append((i, size))
                else:
                    results[i] = ReadResult(status, size if status is Status.BUFFER_TOO_SMALL else 0)
                    done.add(i)
            # Keyed by the get_reply just received (see Session); an object this reader verifies
            # against its own record is hashed without a seed, as the record was.
            pkeys = conn.session.payload_keys(False, conn.session.received - 1, len(incoming))
            sums = []
            for (i, size), (seed, _) in zip(incoming, pkeys):
                # Hashed piece by piece as it arrives, while each piece is still in the CPU cache.
                hasher = xxhash.xxh3_64(seed=0 if checksums is not None and checksums[i] else seed)
                recv_exactly_into(conn.sock, views[i][:size], deadline, hasher)
                self._count("bytes_received", size)
                sums.append(hasher.intdigest())
            if incoming:
                send_header(conn.sock, Header(op="get_ack", req=req), deadline, conn.session)
            end = self._expect(read_header(conn.sock, self._max_object_bytes, deadline, session=conn.session),
                               "get_end", req, address)
            if len(end.statuses) != len(incoming):
                raise _Failure("protocol", f"{address}: get_end has {len(end.statuses)} statuses for "
                                           f"{len(incoming)} objects")
            bad = 0
            for (i, size), st, want, got, (_, mask) in zip(incoming, end.statuses, end.checksums, sums, pkeys):
                if Status(st) is not Status.OK:
                    results[i] = ReadResult(Status.IO_ERROR)  # its lease expired while it was sent
                    self._count("failures_peer_gone")
                elif (want ^ mask != got if checksums is None or not checksums[i] else checksums[i] != got):
                    results[i] = ReadResult(Status.CORRUPT)
                    bad += 1
                else:
                    results[i] = ReadResult(Status.OK, size)
                done.add(i)
            if bad:
                self._count("failures_checksum", bad)
                logger.warning("pool transport: %d objects from %s failed their checksum", bad, address)

        try:
            self._exchange(address, deadline, body)
        except Exception as e:  # noqa: BLE001 - every failure is per-key data
            left = [i for i in idx if i not in done]
            for i in left:
                results[i] = ReadResult(Status.IO_ERROR)
            self._fail(e, address, "get", len(left))

    # -- put --------------------------------------------------------------------------------------
    def put(self, address: str, keys: Sequence[str], buffers: Sequence[Buffer], *,
            timeout_s: float = 10.0) -> list[Status]:
        """See :meth:`store_backend.pool.transport.Transport.put`."""
        check_batch(keys, buffers)
        parse_address(address)
        views = [byte_view(b) for b in buffers]
        deadline = time.monotonic() + timeout_s
        results: list[Status] = [Status.IO_ERROR] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            if check_key(k) is not None:
                results[i] = Status.INVALID_KEY
            elif views[i].nbytes > self._max_object_bytes:
                results[i] = Status.TOO_LARGE
            else:
                todo.append(i)
        self._run_split(todo, views, lambda idx: self._put_part(address, idx, keys, views, deadline, results))
        return results

    def _put_part(self, address: str, idx: list[int], keys: Sequence[str], views: list[memoryview],
                  deadline: float, results: list[Status]) -> None:
        done: set[int] = set()

        def body(conn: _Conn) -> None:
            req = next(self._req) & MAX_U64
            self._count("requests")
            # Keyed by the put header, by position (see Session).
            pkeys = conn.session.payload_keys(True, conn.session.sent, len(idx))
            self._send_request(conn, Header(op="put", req=req, keys=[keys[i] for i in idx],
                                            sizes=[views[i].nbytes for i in idx]), deadline)
            accept = self._first_reply(conn, self._max_object_bytes, deadline, "put_accept", req)
            if len(accept.statuses) != len(idx):
                raise _Failure("protocol", f"{address}: put_accept has {len(accept.statuses)} statuses for "
                                           f"{len(idx)} keys")
            sending = []
            for i, st, pk in zip(idx, accept.statuses, pkeys):
                if Status(st) is Status.OK:
                    sending.append((i, pk))
                else:
                    results[i] = Status(st)
                    done.add(i)
            sums = []
            for i, (seed, mask) in sending:
                hasher = xxhash.xxh3_64(seed=seed)
                send_view(conn.sock, views[i], deadline, hasher)
                self._count("bytes_sent", views[i].nbytes)
                sums.append(hasher.intdigest() ^ mask)
            send_header(conn.sock, Header(op="put_end", req=req, checksums=sums), deadline, conn.session)
            reply = self._expect(read_header(conn.sock, self._max_object_bytes, deadline, session=conn.session),
                                 "put_reply", req, address)
            if len(reply.statuses) != len(idx):
                raise _Failure("protocol", f"{address}: put_reply has {len(reply.statuses)} statuses for {len(idx)} keys")
            for i, st in zip(idx, reply.statuses):
                results[i] = Status(st)
                done.add(i)
            corrupt = sum(1 for i, _ in sending if results[i] is Status.CORRUPT)
            if corrupt:
                self._count("failures_checksum", corrupt)

        try:
            self._exchange(address, deadline, body)
        except Exception as e:  # noqa: BLE001 - every failure is per-key data
            left = [i for i in idx if i not in done]
            for i in left:
                results[i] = Status.IO_ERROR
            self._fail(e, address, "put", len(left))

    # -- wait -------------------------------------------------------------------------------------
    def wait_stored(self, address: str, keys: Sequence[str], *, wait_s: float,
                    timeout_s: float = 10.0) -> list[ReadResult]:
        """See :meth:`store_backend.pool.transport.Transport.wait_stored`."""
        check_batch(keys)
        parse_address(address)
        if not (isinstance(wait_s, (int, float)) and 0 <= wait_s <= MAX_WAIT_S):
            raise ValueError(f"wait_s must be a number in [0, {MAX_WAIT_S:g}], got {wait_s!r}")
        results = [ReadResult(Status.IO_ERROR)] * len(keys)
        if any(check_key(k) is not None for k in keys):
            return [ReadResult(Status.INVALID_KEY if check_key(k) is not None else Status.NOT_FOUND) for k in keys]
        until = time.monotonic() + wait_s
        for j in range(0, len(keys), KEYS_PER_FRAME):
            part = list(keys[j:j + KEYS_PER_FRAME])
            left = max(0.0, until - time.monotonic())
            deadline = time.monotonic() + left + timeout_s

            def body(conn: _Conn, j: int = j, part: list[str] = part, left: float = left) -> None:
                req = next(self._req) & MAX_U64
                self._count("requests")
                self._send_request(conn, Header(op="wait", req=req, keys=part, wait_s=left), deadline)
                reply = self._first_reply(conn, self._max_object_bytes, deadline, "wait_reply", req)
                if len(reply.statuses) != len(part):
                    raise _Failure("protocol", f"{address}: wait_reply has {len(reply.statuses)} statuses "
                                               f"for {len(part)} keys")
                for i, (st, size) in enumerate(zip(reply.statuses, reply.sizes)):
                    results[j + i] = ReadResult(Status(st), size if st == Status.OK else 0)

            try:
                self._exchange(address, deadline, body)
            except Exception as e:  # noqa: BLE001 - every failure is per-key data
                self._fail(e, address, "wait", len(part))
                break
            if any(r.status is not Status.OK for r in results[j:j + len(part)]):
                return [r if r.status is Status.OK or i < j + len(part) else ReadResult(Status.NOT_FOUND)
                        for i, r in enumerate(results)]
        return results

    # -- remove -----------------------------------------------------------------------------------
    def remove(self, address: str, keys: Sequence[str], *, timeout_s: float = 10.0,
               before_s: float = 0.0) -> list[Status]:
        """See :meth:`store_backend.pool.transport.Transport.remove`."""
        check_batch(keys)
        parse_address(address)
        if not (isinstance(before_s, (int, float)) and 0 <= before_s < float("inf")):
            raise ValueError(f"before_s must be a finite number >= 0, got {before_s!r}")
        deadline = time.monotonic() + timeout_s
        results: list[Status] = [Status.IO_ERROR] * len(keys)
        todo = []
        for i, k in enumerate(keys):
            if check_key(k) is not None:
                results[i] = Status.INVALID_KEY
            else:
                todo.append(i)
        for j in range(0, len(todo), KEYS_PER_FRAME):
            idx = todo[j:j + KEYS_PER_FRAME]

            def body(conn: _Conn, idx: list[int] = idx) -> None:
                req = next(self._req) & MAX_U64
                self._count("requests")
                self._send_request(conn, Header(op="remove", req=req, keys=[keys[i] for i in idx],
                                                before_s=before_s), deadline)
                reply = self._first_reply(conn, self._max_object_bytes, deadline, "remove_reply", req)
                if len(reply.statuses) != len(idx):
                    raise _Failure("protocol", f"{address}: remove_reply has {len(reply.statuses)} statuses "
                                               f"for {len(idx)} keys")
                for i, st in zip(idx, reply.statuses):
                    results[i] = Status(st)

            try:
                self._exchange(address, deadline, body)
            except Exception as e:  # noqa: BLE001 - every failure is per-key data
                self._fail(e, address, "remove", len(idx))
        return results
