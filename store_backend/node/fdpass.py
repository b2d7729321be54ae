"""Unix-socket plumbing the node service and its clients share: passing a file descriptor
(SCM_RIGHTS), the peer's credentials (SO_PEERCRED), and the check of who may attach.

The service hands each client the arena segment as an fd next to its ``welcome`` frame, so a client
never opens the segment by path (a path may meanwhile name a newer service's segment). A passed fd
shares the sender's open file description; the service passes one it opened for the purpose
(:func:`reopen_fd`), never the one holding its lock (an flock belongs to the open file
description, so a client holding it would block the next service).

All functions block on the socket as its timeout says; none is thread-safe against other reads or
writes of the same socket.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import NamedTuple

# Ancillary data the receiver takes per message (the segment's fd); more is refused.
MAX_FDS = 1

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FdPassError(OSError):
    """An fd that did not come across as one whole fd (truncated ancillary data, too many fds)."""


class PeerAccessError(PermissionError):
    """A peer whose user may not attach to this service."""


class PeerCredentials(NamedTuple):
    """The connecting process as the kernel saw it at connect() (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The peer of a connected Unix socket: OSError when the socket has none (not AF_UNIX)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


def may_attach(peer_uid: int, service_uid: int) -> bool:
    """The access rule: the service's own user, or root."""
    return peer_uid == service_uid or peer_uid == 0


def check_peer(creds: PeerCredentials, service_uid: int, path: str) -> None:
    """:class:`PeerAccessError` naming both users and the socket when ``creds`` may not attach."""
    if not may_attach(creds.uid, service_uid):
        raise PeerAccessError(f"uid {creds.uid} (pid {creds.pid}) may not attach to the node service of uid "
                              f"{service_uid} at {path}")


def send_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    """Send ``data`` (non-empty: the fd rides on its first byte) with ``fd`` attached. Blocking;
    the caller keeps its own ``fd`` (the receiver gets a new descriptor for the same open file)."""
    if not data:
        raise ValueError("send_fd needs at least one byte of data to carry the fd")
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_fd(sock: socket.socket, bufsize: int) -> tuple[bytes, int | None]:
    """Up to ``bufsize`` bytes and the fd that came with them (None when none did). The caller owns
    the returned fd and closes it. b"" at end of stream. :class:`FdPassError` when the peer sent more
    fds than :data:`MAX_FDS` or the ancillary data was cut short (every fd received is closed first)."""
    data, fds, flags, _addr = socket.recv_fds(sock, bufsize, MAX_FDS + 1)
    if len(fds) > MAX_FDS or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        why = f"{len(fds)} fds" if len(fds) > MAX_FDS else "truncated ancillary data"
        raise FdPassError(f"expected at most {MAX_FDS} fd with the message, got {why}")
    return data, (fds[0] if fds else None)


def reopen_fd(fd: int, flags: int = os.O_RDWR) -> int:
    """A new open file description of the file ``fd`` names (not a dup: its own offset, flags and
    locks), for handing to another process."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def fd_identity(fd: int) -> str:
    """``"<st_dev>:<st_ino>"``: which file an fd is (a receiver checks it against what it was told)."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"
