"""The TCP pool transport: :class:`TcpTransportServer` (serves a node's store to its peers) and
:class:`TcpTransport` (reads from and writes to peers), the wire format of
:mod:`store_backend.pool.frames`, authenticated by :mod:`store_backend.pool.auth`.

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

Client: a bounded pool of authenticated connections per peer, reused across calls; a connection
that failed in any way is closed, never reused. A batch is split by bytes over up to ``streams``
connections run in parallel (the caller's thread runs one, the transport's owned workers the
rest). Objects are received with ``recv_into`` straight into the caller's buffers.

Every frame after the handshake is tagged with the connection's session key and every payload
checksum is keyed by it (:class:`~store_backend.pool.frames.Session`): a relay without the secret
cannot change a request, a reply or a payload unnoticed. Checksums are computed inline, piece by piece (256 KiB) as each piece is received or just before
it is sent, while it is in the CPU cache: measured here that costs 0.33-0.40 CPU-s per GB on the
reader against 0.5 with a hash thread reading the whole object again afterwards (xxhash releases
the GIL, but the second pass over DRAM costs more than it overlaps). The sendfile path cannot hash
inline (the bytes never pass through the server), so it hashes on the server's hash threads. Every call is bounded by its
``timeout_s`` (one deadline for the whole call; every socket wait gets what is left of it).
Thread-safe; no lock is held across I/O.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from store_backend.pool.auth import (AuthError, RefusedError, client_handshake, refuse, secret_bytes,
                                     server_handshake)
from store_backend.pool.frames import (MAX_U64, REQUEST_OPS, FrameError, Header, PeerClosedError, Session, TagError,
                                       read_header, recv_exactly_into, send_header, send_view, wait_readable)
from store_backend.pool.transport import FAILURE_KINDS, TRANSPORT_OWNER_BASE, FailureKind, TransportError
from store_backend.threads import Deadline, join_threads, shutdown_pool
from store_backend.types import Buffer, ReadResult, Status, byte_view, check_batch, check_key

logger = logging.getLogger(__name__)

DEFAULT_SOCKET_BUFFER_BYTES = 4 << 20
# Keys per request frame: 512 keys of the longest (1 KiB) keep a header well under its 1 MiB cap.
KEYS_PER_FRAME = 512
# A batch smaller than this per extra stream is not split (a connection's round trip costs more).
MIN_STREAM_BYTES = 1 << 20
_ACCEPT_POLL_S = 0.2
# Usable CPUs below which one batch goes over a single connection (see auto_streams).
MIN_CPUS_FOR_TWO_STREAMS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_streams(cpus: int | None = None) -> int:
    """Connections one batch is split over when none is configured: 1 on a host with fewer than
    MIN_CPUS_FOR_TWO_STREAMS usable CPUs (``cpus``, default :func:`usable_cpus`), else 2.

    Measured on a 2-CPU host (a reader and a server on loopback): a second stream cost the reader
    0.31-0.55 CPU-s per GB against 0.19-0.29 for one (GIL hand-offs and four busy threads on two
    CPUs) and moved 0.76-0.91 of a plain socket's rate where one stream moved 0.88-1.04
    (docs/PERFORMANCE.md, the pool section). Streams overlap only where there are CPUs to run
    them."""
    n = usable_cpus() if cpus is None else cpus
    return 1 if n < MIN_CPUS_FOR_TWO_STREAMS else 2


def checksum(view: memoryview, seed: int = 0) -> int:
    """xxh3-64 of ``view`` with ``seed`` (releases the GIL while it hashes)."""
    return xxhash.xxh3_64_intdigest(view, seed)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as (host, port); TransportError naming the address."""
    if not isinstance(address, str) or ":" not in address:
        raise TransportError(f"address must be 'host:port', got {address!r}")
    host, _, port_s = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise TransportError(f"address {address!r}: port {port_s!r} is not a number") from None
    if not host or not 0 < port < 65536:
        raise TransportError(f"address {address!r}: needs a host and a port in 1..65535")
    return host, port


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY (headers must not wait for Nagle) and larger socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass


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


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def sendfile_range(sock: socket.socket, fd: int, offset: int, count: int, deadline: float) -> None:
    """Send ``count`` bytes of file ``fd`` from ``offset`` (``os.sendfile``: the kernel copies from
    the page cache, nothing passes through this process), bounded by ``deadline``."""
    out = sock.fileno()
    poller = None
    while count > 0:
        try:
            k = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            k = -1
        if k == 0:
            raise OSError(f"sendfile: the segment ended at offset {offset} with {count} bytes left")
        if k > 0:
            offset += k
            count -= k
            continue
        if poller is None:
            poller = select.poll()
            poller.register(out, select.POLLOUT)
        if not poller.poll(max(1, int(_left(deadline) * 1000))):
            _left(deadline)


# -- server ---------------------------------------------------------------------------------------

class TcpTransportServer:
    """Serves ``store`` (anything with the slot API of :class:`store_backend.api.KVStore`) to
    peers that prove ``secret``. ``start()`` binds; ``close()`` ends it. Thread-safe."""

    def __init__(self, store: Any, secret: str | bytes, host: str = "127.0.0.1", port: int = 0, *,
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
                                     "sendfile_bytes"), 0)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}
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
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"mkv-pool-accept-{bound[1]}",
                                               daemon=True)
        self._accept_thread.start()
        logger.info("pool transport serving on %s (sendfile %s)", self._address,
                    "on" if self._segment_fd >= 0 else "off")

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
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        join_threads([t for _, t in conns], deadline, owner="pool transport server")
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
            t = threading.Thread(target=self._serve, args=(sock, seq, peer), daemon=True,
                                 name=f"mkv-pool-conn-{seq}")
            dropped = None
            with self._lock:
                if len(self._handshaking) >= self.max_handshakes:
                    dropped = self._handshaking.pop(next(iter(self._handshaking)))
                self._handshaking[seq] = sock
                self._conns[seq] = (sock, t)
            if dropped is not None:
                # Its thread's handshake fails at once (and counts it); a proven peer is never
                # dropped here: it left _handshaking under the lock before its auth_ok.
                try:
                    dropped.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            t.start()

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


def split_by_bytes(sizes: Sequence[int], streams: int, min_stream_bytes: int = MIN_STREAM_BYTES) -> list[range]:
    """Contiguous index ranges of ``sizes``, at most ``streams`` of them, of about equal bytes
    (a stream gets at least ``min_stream_bytes``). Pure."""
    n = len(sizes)
    total = sum(sizes)
    k = max(1, min(streams, n, total // max(1, min_stream_bytes)))
    if k == 1:
        return [range(n)] if n else []
    out: list[range] = []
    start, acc, target = 0, 0, total / k
    for i, s in enumerate(sizes):
        acc += s
        if acc >= target * (len(out) + 1) and len(out) < k - 1 and i + 1 < n:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, n))
    return out


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
        sock = socket.create_connection((host, port), timeout=_left(deadline))
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
