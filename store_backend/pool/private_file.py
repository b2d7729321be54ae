"""The checks a file holding a secret passes before it is read: a secret file (the pool's shared
secret, the Redis password, the TLS key), and a config file that holds a secret inline (the pool's
``secret``, a Redis password in ``directory.url``): a regular file of this user (or root) that
neither group nor other may read or write."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from store_backend.config_loader import ConfigError


def private_file_problem(path: str) -> str | None:
    """None when ``path`` is a regular file owned by this process's effective uid or root with no
    group or other permission bits, else what is wrong with it, worded to follow the path ("is not
    a regular file", ...). OSError when it cannot be stat'ed (the caller names the field).
    Blocking (one stat)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (f"is owned by uid {st.st_uid}, not by this user (uid {me}) or root: that user can read and "
                f"change it; chown {me} it")
    if st.st_mode & 0o077:
        return f"is readable by group or other (mode {st.st_mode & 0o777:04o}): chmod 600 it"
    return None


def check_private_file(path: str, lead: str) -> None:
    """ValueError unless ``path`` passes :func:`private_file_problem`, its text ``lead`` (what names
    the field, e.g. ``"tls.key_file: "``) then the path and what is wrong, or that it cannot be
    read and why. Blocking (one stat)."""
    try:
        problem = private_file_problem(path)
    except OSError as e:
        raise ValueError(f"{lead}cannot read {path}: {e.strerror}") from None
    if problem is not None:
        raise ValueError(f"{lead}{path} {problem}")


def check_config_file_secrets(path: str | os.PathLike[str], fields: Sequence[tuple[str, str]]) -> None:
    """ConfigError (a ValueError) unless the config file ``path`` is private when it holds secrets
    inline: owned by this process's effective uid or root, no group or other permission bits (the
    file itself, links followed). ``fields`` lists (the field holding one, e.g. ``"pool.secret"``; the field to
    name the secret's file in instead, e.g. ``"pool.secret_file"``). The message names the file,
    the field, the owner and mode, and the fix; never the secret. Nothing to check without
    ``fields``. Blocking (one stat)."""
    if not fields:
        return
    field, file_field = fields[0]
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{field}: cannot check the config file {path} that holds it: {e.strerror}") from None
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (me, 0):
        why = f"is owned by uid {st.st_uid}, not by this user (uid {me}) or root"
    elif mode & 0o077:
        why = "is readable by group or other"
    else:
        return
    raise ConfigError(
        f"{field}: the config file {path} holds this secret inline and {why} (owner uid {st.st_uid}, mode "
        f"{mode:04o}): make it private (chmod 600 {path}, owned by the service's user), or name a file "
        f"holding the secret in {file_field} instead")
