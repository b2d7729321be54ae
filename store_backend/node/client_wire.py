"""The node service's client wire: one connection to the service (:class:`Connection`: a socket after
its welcome, one request and its reply at a time), the handshake that opens it (:func:`hello`: the
socket directory and the serving process checked before a byte is sent, the segment's fd received
with the welcome), :func:`probe`, and the reconnect :class:`Backoff`. :class:`Lost` and
:class:`Refused` are how a connection fails; :class:`~store_backend.node.client.NodeClient` turns
them into per-key misses. Blocking; a connection is used by one thread at a time.
"""

from __future__ import annotations

import os
import socket
import time

from store_backend.config import ConfigError
from store_backend.framing import READ_PIECE_BYTES, FrameError, read_frame
from store_backend.node import protocol as p
from store_backend.node.fdpass import may_attach, peer_credentials, recv_fd
from store_backend.node.mapping import SegmentMapping
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach, check_socket_to_attach


class Backoff:
    """When the next connect may be tried: ``first_s`` after the first failure, doubling up to
    ``max_s``; a success resets it. Pure (the caller passes the monotonic clock); not thread-safe."""

    def __init__(self, first_s: float = 0.05, max_s: float = 2.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0
        self.not_before = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.not_before

    def wait_s(self, now: float) -> float:
        return max(0.0, self.not_before - now)

    def failed(self, now: float) -> float:
        """Record a failed attempt at ``now``; the delay until the next one may be made."""
        delay = min(self.first_s * (2 ** min(self.failures, 30)), self.max_s)
        self.failures += 1
        self.not_before = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.not_before = 0.0


class Lost(Exception):
    """The service could not be asked over this connection (gone, restarting, hung, or broke the
    protocol): the caller answers per key as a miss. ``hung_up``: the service closed the connection
    (EOF, reset), as it does to an idle one; worth one retry on a new connection."""

    def __init__(self, message: str, hung_up: bool = False) -> None:
        super().__init__(message)
        self.hung_up = hung_up


class Refused(Exception):
    """The service answered ``error``: ``closed`` (draining) keeps the connection, others drop it."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class Connection:
    """One connected socket after its welcome. Used by one thread at a time (the pool's ``busy``)."""

    def __init__(self, sock: socket.socket, decoder: p.MessageDecoder, pending: list[bytes],
                 welcome: p.Welcome, mapping: SegmentMapping) -> None:
        self.sock = sock
        # Opened past the pool's bound for a call that may not wait for a busy connection (a
        # commit, abort or release: a call in flight may be waiting for it): closed after it.
        self.extra = False
        self.waiting = False  # in a call that waits on purpose (close interrupts it)
        self.decoder = decoder
        self.pending = pending
        self.welcome = welcome
        self.mapping = mapping
        self.max_frame_bytes = welcome.max_frame_bytes
        self.granted = False  # the service may have granted tokens on it (a reserve or lease was sent)
        self.busy = False
        self.dead = False
        self.draining = False
        self.answered = 0  # replies read: a connection that answered before may have been closed idle
        self._next_id = 1

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def round_trip(self, payload: bytes, request_id: int, timeout_s: float | None) -> p.Frame:
        """Send one encoded request and read its reply (a ``draining`` push on the way is noted).
        Lost for anything but a reply with ``request_id``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(payload)
            while True:
                body = read_frame(self.sock, self.decoder.frames, self.pending, deadline)
                if body is None:
                    raise Lost("the node service closed the connection", hung_up=True)
                msg = self.decoder.decode(body)
                if isinstance(msg, p.Draining):
                    self.draining = True
                    continue
                if msg.id == request_id:
                    self.answered += 1
                    return msg
                if isinstance(msg, p.Error):
                    raise Lost(f"the node service refused the connection: {msg.code}: {msg.message}")
                raise Lost(f"reply {type(msg).__name__} id {msg.id} to request {request_id}")
        except (ConnectionResetError, BrokenPipeError) as e:
            raise Lost(f"{type(e).__name__}: {e}", hung_up=True) from None
        except (OSError, FrameError) as e:
            raise Lost(f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        self.dead = True
        try:
            self.sock.close()
        except OSError:
            pass


def _check_service_peer(sock: socket.socket, path: str) -> None:
    """The process serving ``path`` must run as this user or root (SO_PEERCRED, as the kernel saw it
    at listen()): else NodeAccessError, before a byte is sent to it or read from it."""
    try:
        creds = peer_credentials(sock)
    except OSError as e:
        raise NodeAccessError(f"cannot tell who serves the node service socket {path}: {e}") from None
    if not may_attach(creds.uid, os.getuid()):
        raise NodeAccessError(f"the node service socket {path} is served by uid {creds.uid} (pid {creds.pid}), "
                              f"not by this process's uid {os.getuid()} or root; refusing to attach")


def hello(path: str, name: str, want_segment: bool, timeout_s: float,
           ) -> tuple[socket.socket, p.MessageDecoder, list[bytes], p.Welcome, int | None]:
    """Connect to ``path`` and say hello: the socket, its decoder state, the welcome and the segment
    fd that came with it (the caller owns both). Raises ConnectionRefusedError/FileNotFoundError when
    no service listens there (or its directory does not exist), NodeAccessError (a socket directory
    another user could serve from, a socket file another user made, a service run by another user),
    ConfigError (protocol version), Lost for the rest."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fd: int | None = None
    try:
        check_socket_dir_to_attach(os.path.dirname(os.path.abspath(path)))
        check_socket_to_attach(path)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except PermissionError as e:
            raise NodeAccessError(_access_message(path, e)) from None
        except (FileNotFoundError, ConnectionRefusedError):
            raise
        except OSError as e:
            raise Lost(f"connect to {path}: {e}") from None
        _check_service_peer(sock, path)
        decoder = p.MessageDecoder(p.Reply)
        pending: list[bytes] = []
        try:
            sock.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION, os.getpid(), name, want_segment)))
            # The fd rides on the welcome's first byte: read with recvmsg until a frame is whole.
            while not pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Lost(f"no welcome from {path} within {timeout_s} s")
                sock.settimeout(left)
                data, got = recv_fd(sock, READ_PIECE_BYTES)
                if got is not None:
                    if fd is None:
                        fd = got
                    else:
                        os.close(got)
                if not data:
                    decoder.frames.eof()
                    raise Lost(f"the node service at {path} closed the connection before its welcome")
                pending.extend(decoder.frames.feed(data))
            msg = decoder.decode(pending.pop(0))
        except (OSError, FrameError) as e:
            raise Lost(f"hello to {path}: {type(e).__name__}: {e}") from None
        if isinstance(msg, p.Error):
            if msg.code == "permission":
                raise NodeAccessError(f"{msg.message} (socket {path}, this process runs as uid {os.getuid()})")
            if msg.code == "version":
                raise ConfigError(f"the node service at {path} refused protocol version {p.PROTOCOL_VERSION}: "
                                  f"{msg.message}")
            raise Lost(f"the node service at {path} refused hello: {msg.code}: {msg.message}")
        if not isinstance(msg, p.Welcome) or msg.id != 1:
            raise Lost(f"the node service at {path} answered hello with {type(msg).__name__}")
        if msg.version != p.PROTOCOL_VERSION:
            raise ConfigError(f"the node service at {path} speaks protocol version {msg.version}, this client "
                              f"{p.PROTOCOL_VERSION}")
        if want_segment and fd is None:
            raise Lost(f"the node service at {path} sent no segment fd with its welcome")
        out_fd, fd = fd, None
        return sock, decoder, pending, msg, out_fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        sock.close()
        raise


def _access_message(path: str, e: OSError) -> str:
    directory = os.path.dirname(path) or "."
    try:
        st = os.stat(directory)
        where = f"{directory} belongs to uid {st.st_uid}, mode {st.st_mode & 0o777:o}"
    except OSError as se:
        where = f"{directory}: {se.strerror}"
    return (f"uid {os.getuid()} may not connect to the node service socket {path}: {e.strerror} ({where}; "
            f"the service admits only its own user)")


def probe(path: str, timeout_s: float = 2.0) -> p.Welcome | None:
    """The welcome of the service answering at ``path`` (no segment asked), or None when none answers.
    NodeAccessError when one answers but this user may not attach; ConfigError for another protocol
    version. Blocking, at most about ``timeout_s``."""
    try:
        sock, _d, _p, welcome, fd = hello(path, "probe", False, timeout_s)
    except (FileNotFoundError, ConnectionRefusedError, Lost):
        return None
    if fd is not None:
        os.close(fd)
    try:
        sock.sendall(p.encode(p.Goodbye(2)))
    except OSError:
        pass
    sock.close()
    return welcome
