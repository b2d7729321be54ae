"""Opening an SSD backend's directory: make it (private), lock it, and say clearly why that failed.

Called first by every backend's constructor, before it reads, truncates, recovers or deletes
anything in the directory (see :mod:`store_backend.ownership`). Any thread; not on a hot path.
"""

from __future__ import annotations

import errno
import logging
import os

from store_backend.config import ConfigError, SsdConfig
from store_backend.ownership import DirectoryLock
from store_backend.private import check_private_dir, make_private_dirs, tighten_tree
from store_backend.ssd.io.requests import probe_direct_io

logger = logging.getLogger(__name__)


def open_directory(cfg: SsdConfig, *, shared: bool = False) -> DirectoryLock:
    """Create ``cfg.path`` if needed (mode 0700, and so is each directory made above it) and take
    its owner lock (exclusive unless ``shared``).

    A directory that is there must be this user's and written by nobody else
    (:func:`store_backend.private.check_private_dir`); then, before anything is made in it, whatever
    in it group or others may read is made private, with one log line, and an entry of another user,
    or one others may write, is refused (:func:`store_backend.private.tighten_tree`). Raises
    :class:`ConfigError` naming ``ssd.path`` and the reason (a file is in the way, no permission,
    read-only file system), ``NotPrivateError`` (a ConfigError) naming the path, owner, mode and
    fix, and ``OwnershipError`` when another store holds it.
    """
    path = cfg.path
    try:
        made = make_private_dirs(path)
    except OSError as e:
        raise ConfigError(f"ssd.path={path!r}: cannot create the directory: {e.strerror}"
                          f"{' (a parent is a file)' if e.errno == errno.ENOTDIR else ''}") from None
    if not made:
        check_private_dir(path, "ssd.path")
        # Before the lock file is opened in it (one of another user is refused, never written to).
        # Modes only: a live owner's files lose group and other access, nothing else changes.
        try:
            tighten_tree(path, "ssd.path")
        except OSError as e:
            raise ConfigError(f"ssd.path={path!r}: cannot make it private: {e.strerror}") from None
    return DirectoryLock(path, field="ssd.path", shared=shared)


def direct_io_usable(cfg: SsdConfig, backend: str) -> bool:
    """Whether to use O_DIRECT under ``cfg.path`` (``cfg.direct_io`` and the file system allows it)."""
    if not cfg.direct_io:
        return False
    try:
        ok = probe_direct_io(cfg.path)
    except OSError as e:
        raise ConfigError(f"ssd.path={cfg.path!r}: cannot create files there: {e.strerror}") from None
    if not ok:
        logger.warning("O_DIRECT not supported under %s; %s backend uses buffered I/O", cfg.path, backend)
    return ok


def fs_room(path: str, watermark: float) -> tuple[int, int] | None:
    """(bytes the file system uses now, bytes it may use under ``watermark``) for the file system
    holding ``path``; None when the watermark is off (1.0) or the file system reports no size
    (ramfs and friends)."""
    if watermark >= 1.0:
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_blocks <= 0:
        return None
    return (st.f_blocks - st.f_bavail) * st.f_frsize, int(watermark * st.f_blocks * st.f_frsize)
