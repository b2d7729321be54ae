"""The node service's socket directory, checked from both sides: :func:`make_socket_dir` (the
service makes its own directory, 0700, or takes one of its own user's that nobody else may write,
tightening it to 0700) and :func:`check_socket_dir_to_attach` / :func:`check_socket_to_attach` (a
client refuses a directory, or a socket file, another user could have put a service in). File-system
checks (the first also makes the directory and may chmod it); any thread.

The rule on both sides (docs/NODE.md, "Access"): the directory is a real directory (a symbolic link
is refused: another user could point it elsewhere, and clients look at the directory itself) owned
by this user (a client also accepts root's). One that group or others may *write* is refused: a
socket, a lock or a config file may have been planted in it, and taking the write bit away now
would bless them. One that group or others may only read or pass through has nothing planted in it
and is tightened to 0700, with one WARNING line (as ``store_backend.private.ensure_private_dir``
does for the SSD directory). At the service's start, every entry already in it must be its user's
(a socket of another user is never trusted: remove it), and, when the directory was open to
group or others until then, none but a socket may be writable by them (they could have changed
it). Every refusal names the path, its owner uid, its mode and the fix.
"""

from __future__ import annotations

import logging
import os
import socket
import stat

from store_backend.config_loader import ConfigError
from store_backend.node.node_lock import file_kind
from store_backend.private import NotPrivateError, ensure_private_dir

logger = logging.getLogger(__name__)

_GROUP_OTHER = 0o077
_GROUP_OTHER_WRITE = 0o022


class NodeAccessError(PermissionError):
    """This process may not attach to the node service (another user's socket or service); the
    message names the socket path and both uids."""


def make_socket_dir(directory: str) -> None:
    """Make ``directory`` (and the directories missing above it) mode 0700, or take the one there:
    this user's, not a symbolic link, nobody else may write it; group and other access is taken
    away (one WARNING line). Then every entry in it must be this user's, and, when group or others
    could reach it until now, none but a socket may be writable by them. Raises ConfigError (:class:`~store_backend.private.NotPrivateError`
    for the ownership and mode rules) naming the path, its owner and mode, and the fix."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"socket: cannot look at the socket directory {directory}: {e.strerror}") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket: the socket directory {directory} is not a directory ("
                          f"{'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'a file'}, owner uid {st.st_uid}, "
                          f"mode {stat.S_IMODE(st.st_mode):04o}); name a directory of your own in `socket`")
    ensure_private_dir(directory, "socket directory")
    _check_entries(directory, was_open=st is not None and bool(stat.S_IMODE(st.st_mode) & _GROUP_OTHER))


def _check_entries(directory: str, was_open: bool) -> None:
    """Every entry of the (now private) socket directory is this user's; with ``was_open`` (group
    or others could reach the directory until now), none but a socket may be writable by them.
    NotPrivateError naming the entry otherwise (nothing is changed)."""
    me = os.geteuid()
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        raise ConfigError(f"socket: cannot list the socket directory {directory}: {e.strerror}") from None
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != me:
            raise NotPrivateError(
                f"socket: {entry.path} in the socket directory is owned by uid {st.st_uid} (mode {mode:04o}), "
                f"not by this service's uid {me}: another user put it there (a socket or lock of theirs is "
                f"never trusted); remove it (or use another directory in `socket`)", entry.path, st.st_uid, mode)
        if was_open and mode & _GROUP_OTHER_WRITE and not stat.S_ISSOCK(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            raise NotPrivateError(
                f"socket: {entry.path} in the socket directory (owner uid {st.st_uid}, mode {mode:04o}) may be "
                f"written by group or others, who could have changed it; remove it (the service and its "
                f"clients make what they need anew)", entry.path, st.st_uid, mode)


def check_socket_dir_to_attach(directory: str) -> None:
    """Refuse a socket directory another user could have put a service (or a symlink) in: it must
    be a real directory (not a link) owned by this user or root that neither group nor others may
    write. One of this user's that group or others may only read or pass through is tightened to
    0700 here (one WARNING line); root's is refused then (this process cannot tighten it).
    NodeAccessError naming the path, owner, mode and the fix; FileNotFoundError when it does not
    exist (no service there)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NodeAccessError(f"cannot look at the node service's socket directory {directory}: {e}") from None
    mode = stat.S_IMODE(st.st_mode)
    me = os.getuid()
    if not stat.S_ISDIR(st.st_mode):
        raise NodeAccessError(f"the node service's socket directory {directory} is not a directory (a "
                              f"{'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}, owner uid {st.st_uid}, "
                              f"mode {mode:o}); refusing to attach")
    if st.st_uid not in (me, 0):
        raise NodeAccessError(f"the node service's socket directory {directory} is owned by uid {st.st_uid} "
                              f"(mode {mode:o}), not by this process's uid {me} or root: another "
                              f"user could serve that socket; refusing to attach")
    if mode & _GROUP_OTHER_WRITE:
        raise NodeAccessError(f"the node service's socket directory {directory} (owner uid {st.st_uid}) has "
                              f"mode {mode:o}: group or others may write in it, so another user could serve "
                              f"that socket or have planted one; if nobody else wrote in it, make it 0700 "
                              f"(chmod 700 {directory}), or remove it; refusing to attach")
    if mode & _GROUP_OTHER:
        if st.st_uid != me:
            raise NodeAccessError(f"the node service's socket directory {directory} (owner uid {st.st_uid}) has "
                                  f"mode {mode:o}: group or others have access; make it 0700 (chmod 700 "
                                  f"{directory}); refusing to attach")
        try:
            os.chmod(directory, mode & ~_GROUP_OTHER, follow_symlinks=False)
        except OSError as e:
            raise NodeAccessError(f"the node service's socket directory {directory} has mode {mode:o} and "
                                  f"cannot be made 0700: {e.strerror}; refusing to attach") from None
        logger.warning("socket directory=%s: took group and other access away from the directory (mode %04o -> "
                       "%04o)", directory, mode, mode & ~_GROUP_OTHER)


def check_socket_to_attach(path: str) -> None:
    """Refuse a socket file another user made (it is theirs to serve, whoever listens on it now):
    its owner must be this user or root. NodeAccessError naming the path, owner and mode;
    FileNotFoundError when there is none (no service there). The serving process itself is
    checked after the connect (SO_PEERCRED)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NodeAccessError(f"cannot look at the node service socket {path}: {e}") from None
    if st.st_uid not in (os.getuid(), 0):
        raise NodeAccessError(f"the node service socket {path} is owned by uid {st.st_uid} (mode "
                              f"{stat.S_IMODE(st.st_mode):o}), not by this process's uid {os.getuid()} or root: "
                              f"another user made it; remove it; refusing to attach")


# Connections waiting to be accepted: a burst of engine processes attaching at once.
_LISTEN_BACKLOG = max(socket.SOMAXCONN, 1024)


def bind_service_socket(path: str) -> socket.socket:
    """The node service's listening socket at ``path`` (mode 0600, non-blocking), replacing a dead
    service's socket file (the caller holds node.lock); ConfigError naming the path otherwise."""
    # We hold node.lock: a socket here is a dead service's. Anything else is not ours to delete.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"socket: cannot look at {path}: {e.strerror}") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"socket: {path} exists and is not a socket ({file_kind(st.st_mode)}); "
                              f"nothing was deleted: name another path in `socket`, or move that file away")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ConfigError(f"socket: cannot remove the stale socket {path}: {e.strerror}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(_LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise ConfigError(f"socket: cannot listen on {path}: {e.strerror}") from None
    return sock
