"""Prefix lookups answered by the process that owns the store, over a local Unix socket.

An engine's scheduler and its workers may live in different processes (vLLM's API server runs the
scheduler in the engine-core process and each worker in its own). The embedded store lives with the
worker, which saves and loads the bytes; the scheduler must still learn which chunks that store
holds, and lease them until the worker loads them. :class:`LookupServer` (owned by the worker half)
answers ``exists``/``pin``/``unpin`` against its store; :class:`~mooncake_connector.lookup_client.LookupClient`
(used by the scheduler half, :mod:`mooncake_connector.lookup_client`) asks. When both halves share a process the same socket is used, so there is one code path.

Wire format: a 4-byte little-endian length, then a msgpack :class:`Request` or :class:`Reply`. A
frame is at most :data:`MAX_FRAME_BYTES`; the client splits a larger request into several. The
server runs one accept thread and one thread per connection (the scheduler keeps one), at most
``max_connections`` at a time, all owned by the server: ``start()`` creates them, ``close()`` stops
them. The socket file is created with mode 0600 (same user only) and removed on close.

A peer is trusted no further than it must be: a length over the limit or an undecodable frame
closes that connection (one warning per peer process, then debug lines), a body is read as it
arrives (an announced length is never allocated up front), a lease TTL outside
(0, :data:`MAX_LEASE_TTL_S`] is refused with an error naming ``ttl_s``. A connection may idle
between frames for ``idle_timeout_s``; once a frame's first byte has arrived the whole frame must
arrive within ``frame_timeout_s`` (a peer dribbling a byte at a time cannot hold a slot). When all
``max_connections`` slots are taken, a new client makes room by closing the longest-idle
connection (its owner reconnects on its next call); when none is idle it waits in the listen
backlog until a slot frees, and a client that finds the backlog full retries until its timeout, so
a burst of new clients is answered late, never "miss" at once.
"""

from __future__ import annotations

import glob
import logging
import os
import select
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec
import xxhash

# The length-prefixed framing (shared with the node service's control protocol).
from store_backend.framing import MAX_FRAME_BYTES, FrameError  # noqa: F401  (the wire format's bound, re-exported)
from store_backend.framing import recv_frame as _recv
from store_backend.framing import send_frame as _send
from store_backend.node.fdpass import peer_credentials
from store_backend.threads import Deadline, Workers
from store_backend.types import MAX_PIN_TTL_S
from store_backend.types import check_ttl_s as _store_check_ttl_s

logger = logging.getLogger(__name__)

# Longest lease a peer may ask for: a lease bridges one lookup and its load (seconds), and one that
# outlives an hour is a leak that makes objects unevictable.
MAX_LEASE_TTL_S = MAX_PIN_TTL_S
DEFAULT_MAX_CONNECTIONS = 64
# Connections idle this long are closed; the client reconnects on its next call.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# From a frame's first byte to its last: a local peer sends even the largest frame in milliseconds.
DEFAULT_FRAME_TIMEOUT_S = 2.0
# A connection must idle this long before a newcomer may close it to take its slot (one just
# accepted, whose request is in flight, is left alone).
_MIN_IDLE_TO_EVICT_S = 0.2
# Clients beyond max_connections wait here; the kernel caps it at net.core.somaxconn.
_LISTEN_BACKLOG = max(socket.SOMAXCONN, 1024)


def check_ttl_s(ttl_s: float) -> float:
    """``ttl_s`` if it is a usable lease time, else ValueError naming ``ttl_s`` (the store's own
    check: :func:`store_backend.types.check_ttl_s`)."""
    return _store_check_ttl_s(ttl_s)


class PrefixIndex(Protocol):
    """What the server answers from: a store, or a KVClient (which also counts saves in flight)."""

    def exists(self, keys: Sequence[str]) -> int: ...

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]: ...

    def unpin(self, keys: Sequence[str]) -> None: ...


@runtime_checkable
class TierIndex(PrefixIndex, Protocol):
    """A :class:`PrefixIndex` that can also say where each key is (for pin replies' ``tiers``)."""

    def tier_of(self, keys: Sequence[str]) -> list[str | None]: ...


class Request(msgspec.Struct, array_like=True):
    op: Literal["exists", "pin", "unpin"]
    keys: list[str]
    ttl_s: float = 0.0


class Reply(msgspec.Struct, array_like=True):
    count: int = 0  # exists: leading keys present
    present: list[bool] = msgspec.field(default_factory=list)  # pin: presence per key
    # pin: the fastest tier holding each key ("dram", "ssd"; "" when absent), when the server's
    # store can tell (a TierIndex); empty otherwise.
    tiers: list[str] = msgspec.field(default_factory=list)
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


def _peer_pid(conn: socket.socket) -> int | None:
    """The connecting process (SO_PEERCRED), so a bad peer is logged once, not once per connection."""
    try:
        return peer_credentials(conn).pid
    except (AttributeError, OSError):
        return None


class LookupServer:
    """Answers lookups and leases against ``store`` on a Unix socket at ``path``.

    ``start()`` and ``close()`` are called by the owner (not thread-safe against each other); the
    serving threads call ``store`` concurrently, so it must be thread-safe. Counters (read them
    at any time): ``bad_frames``, connections closed for breaking the wire format (a frame slower
    than ``frame_timeout_s`` included); ``slow_frames``, those closed for that alone;
    ``idle_closed``, connections closed for idling, past ``idle_timeout_s`` or to make room for a
    new client; ``errors``, serving threads ended by an exception (a bug; logged with traceback).
    """

    def __init__(self, store: PrefixIndex, path: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
                 on_error: Callable[[], None] | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        if not frame_timeout_s > 0:
            raise ValueError(f"frame_timeout_s must be > 0, got {frame_timeout_s}")
        self.store = store
        self.path = path
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.bad_frames = 0
        self.slow_frames = 0
        self.idle_closed = 0
        self.errors = 0  # exceptions that ended a serving thread (logged with their tracebacks)
        self._on_error = on_error  # told of each of them too (the owner counts it, e.g. in its store)
        # conn -> monotonic time it went idle (waiting for a frame's first byte); absent while a
        # frame is being read or answered. Under _lock.
        self._idle_since: dict[socket.socket, float] = {}
        self._evicted: set[socket.socket] = set()  # shut down for a newcomer, slot not yet back
        self._sock: socket.socket | None = None
        self._workers = Workers(f"lookup server {self.path}")  # the accept thread and one per connection
        self._conns: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._logged_peers: set[int | None] = set()
        self._logged_full = False

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
        sock.listen(_LISTEN_BACKLOG)
        self._sock = sock
        self._workers.start(self._accept_loop, name="kv-lookup-accept")
        return self

    @property
    def open_connections(self) -> int:
        """Client connections accepted and not yet ended (each holds one of ``max_connections``
        slots: mid-frame, answering, or idle). A gauge for monitoring and tests; thread-safe."""
        with self._lock:
            return len(self._conns)

    @property
    def live_connection_threads(self) -> int:
        """Serving threads ("kv-lookup-conn") still running, ended connections' threads that have
        not yet exited included (what ``close`` joins). A gauge; thread-safe."""
        return sum(t.name == "kv-lookup-conn" for t in self._workers.alive())

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop accepting, close every connection, join the threads, remove the socket file.

        Blocking, bounded by ``timeout_s`` for all threads together. Returns how many threads were
        still running then (a store call that hangs under a request): each is logged at WARNING
        by name and left behind (the owner counts them in ``thread_join_timeouts``)."""
        deadline = Deadline(timeout_s)
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
        stuck = self._workers.join(deadline)
        if os.path.exists(self.path):
            os.unlink(self.path)
        return stuck

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            # Take a slot before accepting: past the limit, new clients wait in the listen backlog
            # (their connect has succeeded, their request is buffered) rather than being refused,
            # and while one waits there the longest-idle connection is closed to make room.
            if not self._slots.acquire(blocking=False):
                if not self._logged_full:
                    self._logged_full = True
                    logger.warning("lookup server %s has %d connections, its limit; the longest-idle one "
                                   "makes room for a new client, or new clients wait",
                                   self.path, self.max_connections)
                while True:
                    if self._closed.is_set():
                        return
                    if self._newcomer_waiting():
                        self._close_longest_idle()
                    if self._slots.acquire(timeout=0.1):
                        break
            sock = self._sock
            if sock is None:
                self._slots.release()
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                self._slots.release()
                return
            with self._lock:
                self._conns.add(conn)
            self._workers.start(self._serve, conn, name="kv-lookup-conn")

    def _newcomer_waiting(self) -> bool:
        """Whether a client waits in the listen backlog (the listening socket is readable)."""
        sock = self._sock
        if sock is None:
            return False
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def _close_longest_idle(self) -> None:
        """Full: shut down the connection idle the longest (its thread then frees the slot), if any
        has idled ``_MIN_IDLE_TO_EVICT_S``. Called by the accept thread."""
        now = time.monotonic()
        with self._lock:
            if self._evicted:
                return  # one closed already and its slot is not back yet: one per newcomer
            idle = [(since, c) for c, since in self._idle_since.items() if now - since >= _MIN_IDLE_TO_EVICT_S]
            if not idle:
                return
            _since, victim = min(idle, key=lambda sc: sc[0])
            del self._idle_since[victim]  # closed once; its thread sees end of stream
            self._evicted.add(victim)
            self.idle_closed += 1
        logger.debug("lookup server %s full: closing a connection idle for %.1f s", self.path, now - _since)
        try:
            victim.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _bad_peer(self, pid: int | None, message: str, *args: object) -> None:
        """Log a misbehaving peer: a warning the first time, debug after (one line per peer process)."""
        with self._lock:
            self.bad_frames += 1
            first = pid not in self._logged_peers
            if first:
                if len(self._logged_peers) >= 1024:
                    self._logged_peers.clear()
                self._logged_peers.add(pid)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "lookup peer pid %s " + message + "; closing its connection%s", pid, *args,
                   " (further bad frames from it are logged at debug level)" if first else "")

    def _serve(self, conn: socket.socket) -> None:
        decoder = msgspec.msgpack.Decoder(Request)
        encoder = msgspec.msgpack.Encoder()
        pid = _peer_pid(conn)
        try:
            while not self._closed.is_set():
                # Between frames: idle, for at most idle_timeout_s (and the first to go when full).
                with self._lock:
                    self._idle_since[conn] = time.monotonic()
                conn.settimeout(self.idle_timeout_s)
                try:
                    first = conn.recv(1)
                except TimeoutError:
                    with self._lock:
                        mine = self._idle_since.pop(conn, None) is not None
                        if mine:
                            self.idle_closed += 1
                    logger.debug("lookup connection of pid %s idle for %.0f s; closed", pid, self.idle_timeout_s)
                    return
                with self._lock:
                    if self._idle_since.pop(conn, None) is None:
                        return  # closed to make room for a new client
                if not first:
                    return
                # From the first byte on, the whole frame must arrive within frame_timeout_s.
                try:
                    raw = _recv(conn, first, time.monotonic() + self.frame_timeout_s)
                except FrameError as e:
                    self._bad_peer(pid, "sent a bad frame (%s)", e)
                    return
                except TimeoutError:
                    with self._lock:
                        self.slow_frames += 1
                    self._bad_peer(pid, "sent a frame slower than frame_timeout_s=%g s", self.frame_timeout_s)
                    return
                if raw is None:
                    return
                try:
                    req = decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._bad_peer(pid, "sent an undecodable frame (%s)", e)
                    return
                reply = encoder.encode(self._handle(req, pid))
                conn.settimeout(self.frame_timeout_s)  # a peer that does not read its answer goes too
                _send(conn, reply)
        except OSError:  # TimeoutError included: the reply was not taken in time
            pass
        except Exception:  # a bug, not a peer's fault: said once per connection, with its traceback
            with self._lock:
                self.errors += 1
            logger.exception("lookup connection of pid %s failed; closing it", pid)
            if self._on_error is not None:
                try:
                    self._on_error()
                except Exception:  # the owner's callback must not end this thread unhandled
                    logger.exception("lookup server %s: error callback failed", self.path)
        finally:
            with self._lock:
                self._idle_since.pop(conn, None)
                self._conns.discard(conn)
                if self._logged_full and len(self._conns) <= (self.max_connections - 1) // 2:
                    # Drained to under half (not merely one closed for a newcomer): the next time
                    # it fills is logged again.
                    self._logged_full = False
            conn.close()
            self._slots.release()
            with self._lock:
                self._evicted.discard(conn)  # after the release: its slot is back

    def _handle(self, req: Request, pid: int | None) -> Reply:
        """Answer one request; a bad argument or a failing store is an error reply, the connection stays."""
        try:
            if req.op == "exists":
                return Reply(count=self.store.exists(req.keys) if req.keys else 0)
            if req.op == "pin":
                ttl_s = check_ttl_s(req.ttl_s)
                if not req.keys:
                    return Reply()
                present = self.store.pin(req.keys, ttl_s=ttl_s)
                tiers = self.store.tier_of(req.keys) if isinstance(self.store, TierIndex) else []
                return Reply(present=present, tiers=[t or "" for t in tiers])
            self.store.unpin(req.keys)
            return Reply()
        except ValueError as e:  # the peer's argument (a TTL, a key the store refuses)
            with self._lock:
                first = pid not in self._logged_peers
                self._logged_peers.add(pid)
            logger.log(logging.WARNING if first else logging.DEBUG, "lookup %s from pid %s refused: %s",
                       req.op, pid, e)
            return Reply(error=f"{type(e).__name__}: {e}")
        except Exception as e:  # the store failed (closing, I/O): an error reply, no traceback per call
            logger.warning("lookup %s failed: %s: %s", req.op, type(e).__name__, e)
            return Reply(error=f"{type(e).__name__}: {e}")


# -- the scheduler's view over every KV shard ------------------------------------------------------


