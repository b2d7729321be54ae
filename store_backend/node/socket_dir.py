"""The node service's socket directory, checked from both sides: :func:`make_socket_dir` (the
service makes its own directory, 0700, and refuses one that is not its own) and
:func:`check_socket_dir_to_attach` (a client refuses a directory another user could have put a
service in). File-system checks (the first also makes the directory); any thread.
"""

from __future__ import annotations

import os
import stat

from store_backend.config_loader import ConfigError


class NodeAccessError(PermissionError):
    """This process may not attach to the node service (another user's socket or service); the
    message names the socket path and both uids."""


def make_socket_dir(directory: str) -> None:
    """Make ``directory`` (mode 0700) if it is missing; ConfigError naming path, owner and mode when
    it exists owned by another user, with a mode wider than 0700, or is no directory."""
    try:
        os.makedirs(os.path.dirname(directory) or "/", exist_ok=True)
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"socket: cannot make the socket directory {directory}: {e.strerror}") from None
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise ConfigError(f"socket: cannot read the socket directory {directory}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket: {directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket: the socket directory {directory} is owned by uid {st.st_uid}, not this "
                          f"service's uid {os.getuid()} (mode {mode:04o}); use a directory of your own")
    if mode & 0o077:
        raise ConfigError(f"socket: the socket directory {directory} has mode {mode:04o}, wider than 0700: "
                          f"other users could reach the node service; chmod 700 {directory}")


def check_socket_dir_to_attach(directory: str) -> None:
    """Refuse a socket directory another user could have put a service (or a symlink) in: it must
    be a real directory (not a link) owned by this user or root, with no access for group or others.
    NodeAccessError naming the path, owner and mode; FileNotFoundError when it does not exist (no
    service there)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NodeAccessError(f"cannot look at the node service's socket directory {directory}: {e}") from None
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise NodeAccessError(f"the node service's socket directory {directory} is not a directory (a "
                              f"{'symlink' if stat.S_ISLNK(st.st_mode) else 'file'}, owner uid {st.st_uid}, "
                              f"mode {mode:o}); refusing to attach")
    if st.st_uid not in (os.getuid(), 0):
        raise NodeAccessError(f"the node service's socket directory {directory} is owned by uid {st.st_uid} "
                              f"(mode {mode:o}), not by this process's uid {os.getuid()} or root: another "
                              f"user could serve that socket; refusing to attach")
    if mode & 0o077:
        raise NodeAccessError(f"the node service's socket directory {directory} (owner uid {st.st_uid}) has "
                              f"mode {mode:o}: group or others have access, so another user could serve that "
                              f"socket; make it 0700 (chmod 700 {directory}); refusing to attach")
