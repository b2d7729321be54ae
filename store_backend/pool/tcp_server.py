"""The TCP pool transport's server: :class:`TcpTransportServer` serves a node's store to its peers
in the wire format of :mod:`store_backend.pool.frames`, authenticated by :mod:`store_backend.pool.auth`
(the client is :mod:`store_backend.pool.tcp_client`; what both share, :mod:`store_backend.pool.tcp_common`).

Server: one owned accept thread and one owned thread per connection: at most ``max_handshakes``
still proving the secret (past that the oldest attempt is dropped; each has ``handshake_timeout_s``)
and at most ``max_connections`` authenticated ones (past that a proven peer gets an ``error`` header
and is closed), so peers without the secret cannot crowd out those with it. Each connection is one slot owner
(``TRANSPORT_OWNER_BASE + seq``); when it ends, however it ends, ``store.reclaim(owner)`` gives
back whatever it still held, so a peer that dies mid-transfer leaves nothing leased or reserved.
A get leases its keys (stage_in), sends the leased bytes (``send`` of the lease views, or, with
``use_sendfile``, ``os.sendfile`` from the arena's shared segment: no copy in this process), hashes
each object on the server's hash threads while the next is on the wire, releases once the reader
acknowledged every byte (sendfile queues page references, not copies), and sends the checksums and
the release verdicts last. A put reserves, receives straight into the reserved
slots, verifies the sender's checksums and commits (or aborts).

Frames, checksums and deadlines: :mod:`store_backend.pool.tcp_common`.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from store_backend.pool.auth import AuthError, RefusedError, secret_bytes, server_handshake
from store_backend.pool.frames import (REQUEST_OPS, FrameError, Header, Session, TagError, read_header,
                                       recv_exactly_into, send_header, send_view, wait_readable)
from store_backend.pool.host import PeerView
from store_backend.pool.tcp_common import DEFAULT_SOCKET_BUFFER_BYTES, checksum, sendfile_range, tune_socket
from store_backend.pool.transport import TRANSPORT_OWNER_BASE, TransportError
from store_backend.threads import Deadline, Workers, join_threads, shutdown_pool
from store_backend.types import Status

logger = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2
# A peer's wait is held in slices of this, so a stopping server answers it within one.
_WAIT_SLICE_S = 0.5


def _wait_hashes(futures: Sequence[Future[int] | None]) -> None:
    """Cancel what has not started and wait for the rest, so no hash reads a buffer after return."""
    for f in futures:
        if f is not None:
            f.cancel()
    for f in futures:
        if f is not None and not f.cancelled():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - a failed hash is only waited for here
                pass


class TcpTransportServer:
    """Serves ``store`` (anything with the slot API of :class:`store_backend.api.KVStore`) to
    peers that prove ``secret``. ``start()`` binds; ``close()`` ends it. Thread-safe."""

    def __init__(self, store: PeerView, secret: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = 64, max_handshakes: int = 16, handshake_timeout_s: float = 2.0,
                 frame_timeout_s: float = 30.0,
                 idle_timeout_s: float = 300.0, lease_ttl_s: float = 60.0, max_object_bytes: int | None = None,
                 socket_buffer_bytes: int = DEFAULT_SOCKET_BUFFER_BYTES, use_sendfile: bool = False,
                 hash_threads: int = 2, ssl_context: ssl.SSLContext | None = None) -> None:
        """``max_connections`` bounds authenticated connections (one past it is refused after its
        handshake); ``max_handshakes`` the connections still in their handshake, each for at most
        ``handshake_timeout_s``: one past it drops the oldest attempt (a proven peer answers within
        a round trip, so only a silent one is old), so peers without the secret can neither use up
        ``max_connections`` nor lock a proven peer out by holding sockets open.
        ``frame_timeout_s`` bounds one request's exchange from its header's first byte; ``idle_timeout_s``
        how long a connection may wait between requests; ``max_object_bytes`` (default: the store's
        config) the largest object a header may name. ``use_sendfile``: send leased bytes with
        ``os.sendfile`` from the arena's segment (when it has one) instead of ``send`` of the lease
        views. Off by default: over loopback here it cost more CPU on both ends than the copy it
        saves (the reader's receive of page-backed buffers dominated: 1.5 vs 0.9 CPU-s per GB in
        all, 0.7-1.0 vs 1.65 GB/s at 4 MiB objects); worth measuring on a real NIC.
        ``ssl_context`` (a server-side ``ssl.SSLContext`` with its certificate loaded): every
        connection is TLS first (within ``handshake_timeout_s``), then the shared-secret handshake
        inside it; sendfile is off then (the kernel would send the bytes past TLS)."""
        for name, v in (("max_connections", max_connections), ("max_handshakes", max_handshakes),
                        ("hash_threads", hash_threads)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, f in (("handshake_timeout_s", handshake_timeout_s), ("frame_timeout_s", frame_timeout_s),
                        ("idle_timeout_s", idle_timeout_s), ("lease_ttl_s", lease_ttl_s)):
            if not isinstance(f, (int, float)) or not f > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {f!r}")
        self._store = store
        self._secret = secret_bytes(secret)
        self._host, self._port = host, port
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.handshake_timeout_s = handshake_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.lease_ttl_s = lease_ttl_s
        if max_object_bytes is None:
            cfg = getattr(store, "config", None)
            max_object_bytes = getattr(cfg, "max_object_bytes", 256 << 20)
        self.max_object_bytes = int(max_object_bytes)
        self._buffer_bytes = socket_buffer_bytes
        self._ssl = ssl_context
        self._use_sendfile = use_sendfile and ssl_context is None
        self._hash_threads = hash_threads
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("connections", "auth_failures", "handshake_failures", "bytes_sent",
                                     "bytes_received", "requests", "bad_frames", "bad_tags", "refused_connections",
                                     "sendfile_bytes", "waits", "waiting", "waits_abandoned"), 0)
        self._listener: socket.socket | None = None
        self._workers = Workers("pool transport server")  # the accept thread and one per connection
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[int, socket.socket] = {}
        # Connections in their handshake, oldest first (dict order), and the authenticated count.
        self._handshaking: dict[int, socket.socket] = {}
        self._authenticated = 0
        self._seq = itertools.count(1)
        self._stopping = threading.Event()
        self._hasher: ThreadPoolExecutor | None = None
        self._segment_fd = -1
        self._segment_bytes = 0
        self._address = ""

    @property
    def address(self) -> str:
        """The bound ``host:port`` (valid after :meth:`start`)."""
        return self._address

    def start(self) -> None:
        """Bind and listen; start the accept thread. Blocking only for the bind."""
        if self._listener is not None:
            raise RuntimeError("TcpTransportServer.start() called twice")
        host, port = self._host, self._port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            # Room for a burst of handshakes too: a full backlog drops SYNs (a 1 s retry for a peer).
            listener.listen(min(max(128, 2 * (self.max_connections + self.max_handshakes)), 1024))
            listener.settimeout(_ACCEPT_POLL_S)
        except OSError as e:
            listener.close()
            raise TransportError(f"listen {host}:{port}: cannot bind: {e.strerror or e}") from None
        self._listener = listener
        bound = listener.getsockname()
        self._address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        if self._use_sendfile and self._store.segment() is not None:
            try:
                self._segment_fd = self._store.open_segment_fd()
                self._segment_bytes = self._store.segment().nbytes
            except OSError as e:
                logger.warning("transport server: no sendfile (cannot open the arena's segment: %s)", e)
        self._hasher = ThreadPoolExecutor(self._hash_threads, thread_name_prefix="mkv-pool-srv-hash")
        self._accept_thread = self._workers.start(self._accept_loop, name=f"mkv-pool-accept-{bound[1]}")
        logger.info("pool transport serving on %s (sendfile %s)", self._address,
                    "on" if self._segment_fd >= 0 else "off")

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet ended (in their handshake or proven)."""
        with self._lock:
            return len(self._conns)

    @property
    def sendfile(self) -> bool:
        """Whether objects in the arena are sent with sendfile (valid after :meth:`start`)."""
        return self._segment_fd >= 0

    def stats(self) -> dict[str, int]:
        """Counters (see :class:`~store_backend.pool.transport.TransportServer`), plus
        ``refused_connections`` (proven peers past ``max_connections``), ``handshake_failures``
        (handshakes that ended without a proof: timed out, closed, reset, or dropped for a newer
        one past ``max_handshakes``; a wrong proof is ``auth_failures``), ``bad_tags`` (frames that
        failed their tag; also counted in ``bad_frames``) and ``sendfile_bytes``."""
        with self._lock:
            return dict(self._stats)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, shut every connection down (each reclaims what its peer held) and join
        the threads within ``timeout_s``. Idempotent."""
        deadline = Deadline(timeout_s)
        self._stopping.set()
        if self._accept_thread is not None:
            join_threads([self._accept_thread], deadline, owner="pool transport server")
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._workers.join(deadline)
        shutdown_pool(self._hasher, deadline, owner="pool transport server")
        if self._segment_fd >= 0:
            os.close(self._segment_fd)
            self._segment_fd = -1

    # -- connections ------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set():
                    return
                logger.warning("pool transport: accept failed: %s", e)
                time.sleep(_ACCEPT_POLL_S)
                continue
            seq = next(self._seq)
            if self._ssl is not None:
                try:  # no I/O here: the TLS handshake runs on the connection's thread, bounded
                    sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as e:
                    logger.warning("pool transport: TLS refused %s: %s", peer, e)
                    sock.close()
                    continue
            dropped = None
            with self._lock:
                if len(self._handshaking) >= self.max_handshakes:
                    dropped = self._handshaking.pop(next(iter(self._handshaking)))
                self._handshaking[seq] = sock
                self._conns[seq] = sock
            if dropped is not None:
                # Its thread's handshake fails at once (and counts it); a proven peer is never
                # dropped here: it left _handshaking under the lock before its auth_ok.
                try:
                    dropped.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._workers.start(self._serve, sock, seq, peer, name=f"mkv-pool-conn-{seq}")

    def _admit(self, seq: int) -> str | None:
        """Called once a peer proved the secret: None lets it in (counted against
        ``max_connections``), else why not."""
        with self._lock:
            if self._handshaking.pop(seq, None) is None:
                self._stats["handshake_failures"] += 1
                return "dropped: too many handshakes at once"
            if self._authenticated < self.max_connections:
                self._authenticated += 1
                self._stats["connections"] += 1
                return None
            self._stats["refused_connections"] += 1
        logger.warning("pool transport: refused connection %d: %d connections served already", seq,
                       self.max_connections)
        return f"too many connections (max_connections={self.max_connections})"

    def _serve(self, sock: socket.socket, seq: int, peer: object) -> None:
        owner = TRANSPORT_OWNER_BASE + seq
        admitted = False
        try:
            tune_socket(sock, self._buffer_bytes)
            try:
                if isinstance(sock, ssl.SSLSocket):
                    sock.settimeout(self.handshake_timeout_s)
                    sock.do_handshake()
                session = server_handshake(sock, self._secret, time.monotonic() + self.handshake_timeout_s,
                                           admit=lambda: self._admit(seq))
            except AuthError as e:
                self._count("auth_failures")
                logger.warning("pool transport: refused %s: %s", peer, e)
                return
            except RefusedError:
                return  # counted by _admit
            except (OSError, TimeoutError, FrameError, ValueError) as e:  # ssl.SSLError is an OSError
                self._count("handshake_failures")
                logger.debug("pool transport: handshake of connection %d from %s failed: %r", seq, peer, e)
                return
            admitted = True
            while not self._stopping.is_set():
                # The idle wait ends at the request's first byte; its exchange is bounded from there.
                wait_readable(sock, time.monotonic() + self.idle_timeout_s)
                deadline = time.monotonic() + self.frame_timeout_s
                try:
                    h = read_header(sock, self.max_object_bytes, deadline, session=session)
                    if h.op not in REQUEST_OPS:
                        raise FrameError(f"op: {h.op!r} is not a request ({', '.join(REQUEST_OPS)})")
                except FrameError as e:
                    self._bad_frame(sock, session, peer, e)
                    return
                self._count("requests")
                try:
                    if h.op == "get":
                        self._get(sock, session, h, owner, deadline)
                    elif h.op == "put":
                        self._put(sock, session, h, owner, deadline)
                    elif h.op == "wait":
                        self._wait(sock, session, h)
                    else:
                        statuses = (self._store.remove(h.keys, before_s=h.before_s) if h.before_s
                                    else self._store.remove(h.keys))
                        send_header(sock, Header(op="remove_reply", req=h.req, statuses=[int(s) for s in statuses]),
                                    deadline, session)
                except FrameError as e:
                    self._bad_frame(sock, session, peer, e)
                    return
                except (OSError, TimeoutError):
                    raise
                except Exception as e:  # noqa: BLE001 - the store refused (closed): tell the peer, end
                    logger.warning("pool transport: %s request from %s failed: %r", h.op, peer, e)
                    self._send_error(sock, session, f"{h.op} failed on the server: {type(e).__name__}: {e}")
                    return
        except (OSError, TimeoutError) as e:
            logger.debug("pool transport: connection %d from %s ended: %r", seq, peer, e)
        except Exception:  # noqa: BLE001 - a connection's thread must not die silently
            logger.exception("pool transport: connection %d from %s failed", seq, peer)
        finally:
            try:
                sock.close()
            finally:
                try:
                    self._store.reclaim(owner)
                except Exception as e:  # noqa: BLE001 - a closed store holds nothing any more
                    logger.debug("pool transport: reclaim(%d) failed: %r", owner, e)
                with self._lock:
                    self._conns.pop(seq, None)
                    self._handshaking.pop(seq, None)
                    self._authenticated -= admitted

    def _bad_frame(self, sock: socket.socket, session: Session, peer: object, e: FrameError) -> None:
        self._count("bad_frames")
        if isinstance(e, TagError):
            self._count("bad_tags")
        logger.warning("pool transport: bad frame from %s: %s", peer, e)
        self._send_error(sock, session, f"bad frame: {e}")

    def _send_error(self, sock: socket.socket, session: Session, why: str) -> None:
        try:
            send_header(sock, Header(op="error", error=why[:4000]), time.monotonic() + 1.0, session)
        except (OSError, TimeoutError, FrameError):
            pass

    def _send_object(self, sock: socket.socket, lease: Any, deadline: float, hash_it: bool, seed: int) -> int:
        """Send one leased object; its xxh3-64 (``seed``) when this hashed it (send and ``hash_it``), else 0."""
        n = lease.nbytes
        if self._segment_fd >= 0 and lease.offset + n <= self._segment_bytes:
            sendfile_range(sock, self._segment_fd, lease.offset, n, deadline)
            self._count("sendfile_bytes", n)
            return 0
        if not hash_it:
            send_view(sock, lease.view[:n], deadline)
            return 0
        hasher = xxhash.xxh3_64(seed=seed)
        send_view(sock, lease.view[:n], deadline, hasher)
        return hasher.intdigest()

    def _get(self, sock: socket.socket, session: Session, h: Header, owner: int, deadline: float) -> None:
        assert self._hasher is not None
        leases = self._store.lease(h.keys, ttl_s=self.lease_ttl_s, stage_in=True, owner=owner)
        held = [lease for lease in leases if lease.status is Status.OK]
        statuses: list[int] = []
        sizes: list[int] = []
        sent: list[Any] = []
        known: list[bool] = []  # the reader verifies it against its own record: not hashed here
        for j, (lease, cap) in enumerate(zip(leases, h.sizes)):
            if lease.status is Status.OK and lease.nbytes > cap:
                statuses.append(int(Status.BUFFER_TOO_SMALL))
                sizes.append(lease.nbytes)
            else:
                statuses.append(int(lease.status))
                sizes.append(lease.nbytes if lease.status is Status.OK else 0)
                if lease.status is Status.OK:
                    sent.append(lease)
                    known.append(bool(h.checksums) and h.checksums[j] != 0)
        hashes: list[Future[int] | None] = []
        released = False
        # The payload's checksums are keyed by the get_reply that announces it (see Session).
        pkeys = session.payload_keys(True, session.sent, len(sent))
        try:
            if self._segment_fd >= 0:  # sendfile never reads the bytes here: hash them beside it
                hashes = [None if k else self._hasher.submit(checksum, lease.view[:lease.nbytes], seed)
                          for lease, k, (seed, _) in zip(sent, known, pkeys)]
            send_header(sock, Header(op="get_reply", req=h.req, statuses=statuses, sizes=sizes), deadline, session)
            inline: list[int] = []
            for lease, k, (seed, _) in zip(sent, known, pkeys):
                inline.append(self._send_object(sock, lease, deadline, hash_it=not k, seed=seed))
                self._count("bytes_sent", lease.nbytes)
            if sent:
                # The leases stay held until the reader has every byte (see get_ack in frames).
                ack = read_header(sock, self.max_object_bytes, deadline, session=session)
                if ack.op != "get_ack" or ack.req != h.req:
                    raise FrameError(f"expected get_ack of request {h.req}, got {ack.op} of request {ack.req}")
            sums = [0 if f is None else f.result() for f in hashes] if hashes else inline
            # Masked, so a relay never sees a keyed checksum next to the bytes it covers; 0 stays 0
            # (the reader checks those against its own record).
            sums = [0 if k else c ^ mask for c, k, (_, mask) in zip(sums, known, pkeys)]
            valid = dict(zip((id(x) for x in held), self._store.release(held, owner=owner)))
            released = True
            end = [int(Status.OK) if valid.get(id(lease)) else int(Status.IO_ERROR) for lease in sent]
            send_header(sock, Header(op="get_end", req=h.req, statuses=end, checksums=sums), deadline, session)
        finally:
            if not released:
                _wait_hashes(hashes)
                self._store.release(held, owner=owner)

    def _wait(self, sock: socket.socket, session: Session, h: Header) -> None:
        """A peer's long-poll: answered once every key is committed on this node's own tiers (woken
        by the store's commits), when ``h.wait_s`` passed, when the first key not committed was
        abandoned (its writer's process died with it reserved: it is not coming; answered within
        one slice of that), or when the server stops. The wait is held in slices so a
        stopping server answers within one."""
        until = time.monotonic() + h.wait_s
        n = 0
        self._count("waiting")  # a gauge: the waits held now
        try:
            first = True
            while True:
                left = until - time.monotonic()
                # The first look does not wait: a wait that comes after the writer died ends at once.
                n = self._store.exists(h.keys, wait_s=0.0 if first else max(0.0, min(left, _WAIT_SLICE_S)),
                                       local_only=True)
                first = False
                if n == len(h.keys) or left <= 0 or self._stopping.is_set():
                    break
                if self._store.abandoned(h.keys[n]):
                    self._count("waits_abandoned")
                    break
        finally:
            self._count("waiting", -1)
        sizes = [s or 0 for s in self._store.size_of(h.keys[:n], local_only=True)] if n else []
        n = next((i for i, s in enumerate(sizes) if not s), n)  # removed since: a prefix still
        self._count("waits")
        statuses = [int(Status.OK)] * n + [int(Status.NOT_FOUND)] * (len(h.keys) - n)
        send_header(sock, Header(op="wait_reply", req=h.req, statuses=statuses,
                                 sizes=sizes[:n] + [0] * (len(h.keys) - n)),
                    time.monotonic() + self.frame_timeout_s, session)

    def _put(self, sock: socket.socket, session: Session, h: Header, owner: int, deadline: float) -> None:
        # The payload's checksums are keyed by the put header (the last frame received), by position.
        pkeys = session.payload_keys(False, session.received - 1, len(h.keys))
        res = self._store.reserve(h.keys, h.sizes, ttl_s=self.lease_ttl_s, owner=owner)
        accepted = [r for r in res if r.status is Status.OK]
        masks = [mask for r, (_, mask) in zip(res, pkeys) if r.status is Status.OK]
        open_ = list(accepted)
        try:
            send_header(sock, Header(op="put_accept", req=h.req, statuses=[int(r.status) for r in res]), deadline,
                        session)
            sums = []
            for r, (seed, _) in zip(res, pkeys):
                if r.status is not Status.OK:
                    continue
                hasher = xxhash.xxh3_64(seed=seed)
                recv_exactly_into(sock, r.view[:r.nbytes], deadline, hasher)
                self._count("bytes_received", r.nbytes)
                sums.append(hasher.intdigest())
            end = read_header(sock, self.max_object_bytes, deadline, session=session)
            if end.op != "put_end" or end.req != h.req or len(end.checksums) != len(accepted):
                raise FrameError(f"expected put_end of request {h.req} with {len(accepted)} checksums, got "
                                 f"{end.op} of request {end.req} with {len(end.checksums)}")
            wants = [c ^ mask for c, mask in zip(end.checksums, masks)]
            good = [r for r, got, want in zip(accepted, sums, wants) if got == want]
            bad = [r for r, got, want in zip(accepted, sums, wants) if got != want]
            if bad:
                logger.warning("pool transport: put of %d keys with a wrong checksum (first %r): aborted",
                               len(bad), bad[0].key)
                self._store.abort(bad, owner=owner)
            open_ = []
            committed = dict(zip((id(r) for r in good), self._store.commit(good, owner=owner)))
            out = []
            for r in res:
                if r.status is not Status.OK:
                    out.append(int(r.status))
                elif id(r) in committed:
                    out.append(int(committed[id(r)]))
                else:
                    out.append(int(Status.CORRUPT))
            send_header(sock, Header(op="put_reply", req=h.req, statuses=out), deadline, session)
        finally:
            if open_:
                self._store.abort(open_, owner=owner)
