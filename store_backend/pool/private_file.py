"""The check a file holding a secret (the pool's shared secret, the Redis password) passes before it
is read: a regular file that neither group nor other may read or write."""

from __future__ import annotations

import os
import stat


def private_file_problem(path: str) -> str | None:
    """None when ``path`` is a regular file with no group or other permission bits, else what is
    wrong with it, worded to follow the path ("is not a regular file", ...). OSError when it cannot
    be stat'ed (the caller names the field). Blocking (one stat)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
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
