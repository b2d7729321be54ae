"""Private by default: what the store keeps on disk and in /dev/shm is this user's alone.

Who calls it: the SSD backends (their directory when they open it, every file and sub-directory they
make), the DRAM tier (a named /dev/shm segment) and the cache epoch file
(:mod:`mooncake_connector.epoch`). Files holding secrets have their own check
(:mod:`store_backend.pool.private_file`). Any thread. The functions block on the file system; only
:func:`open_private` and :func:`make_private_dirs` run on a put's path (one ``fchmod`` more per file
a put creates, next to its fsync).

The rules (docs/ARCHITECTURE.md, "Private by default"):

- Every file made here is 0600 and every directory 0700 *whatever the umask*: created with that
  mode, then ``fchmod``'ed to it (a umask only narrows a mode, but one that takes the owner's own
  bits would leave a file its owner cannot use). The process's umask is never changed.
- An existing directory is this user's (owner = the effective uid; root included: a directory of
  another user is refused even for root, since that user can write into it) and nobody else may
  write in it: :func:`check_private_dir`. A symbolic link at the path is followed only when it is
  this user's or root's (another user could point it elsewhere later).
- Inside such a directory, :func:`tighten_tree` refuses anything owned by another user or writable
  by group or others (it may have been planted or changed: the records' checksums use a fixed seed
  and prove nothing against a writer) and takes group and other *read* access away from the rest,
  which an older version left readable (0755 directories, 0644 files), with one log line.
- A refusal is :class:`NotPrivateError` (a ConfigError) naming the path, its owner uid, its mode
  in octal, and the fix.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from store_backend.config import ConfigError

logger = logging.getLogger(__name__)

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_GROUP_OTHER = 0o077
_GROUP_OTHER_WRITE = 0o022


class NotPrivateError(ConfigError):
    """A path another user owns or may write (or, for a segment, may open): the message names the
    path, its owner uid, its mode and the fix."""

    def __init__(self, message: str, path: str, owner_uid: int, mode: int) -> None:
        super().__init__(message)
        self.path = path
        self.owner_uid = owner_uid
        self.mode = mode


def _who(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def open_private(path: str, flags: int) -> int:
    """``os.open(path, flags)`` (O_CLOEXEC added); a file it creates (``flags`` with O_CREAT) is
    0600 whatever the umask, and so is an existing one opened with O_CREAT (fchmod). The caller
    owns the descriptor. Raises OSError as ``os.open`` does."""
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    if flags & os.O_CREAT:
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
    return fd


def make_private_dir(path: str) -> bool:
    """Make the directory ``path`` with mode 0700 whatever the umask; False (nothing changed) when
    something is there already. OSError as ``os.mkdir`` raises it otherwise."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, PRIVATE_DIR_MODE)
    finally:
        os.close(fd)
    return True


def make_private_dirs(path: str, base: str | None = None) -> bool:
    """Make ``path`` and each missing directory above it (below ``base``, which must exist, when
    given) with mode 0700; directories already there are left as they are. True when ``path``
    itself was made here."""
    path = os.path.abspath(path)
    missing: list[str] = []
    stop = None if base is None else os.path.abspath(base)
    p = path
    while p != stop and not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    made = False
    for p in reversed(missing):
        made = make_private_dir(p)
    return made


def check_private_dir(path: str, field: str, *, root_trusts_owner: bool = False) -> os.stat_result:
    """The stat of the existing directory ``path`` once it passes the rules above: a directory
    (or a link to one, the link this user's or root's) owned by this process's effective uid that
    neither group nor others may write. ``root_trusts_owner``: a process running as root also
    accepts another user's directory (the node service's, which a root client attached to and
    trusts already; that user alone may write in it). Raises :class:`NotPrivateError` naming
    ``field``, the path, its owner and mode and the fix; ConfigError when it is no directory or
    cannot be looked at; FileNotFoundError when it is missing. Only stats."""
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError(f"{field}={path!r}: cannot look at it: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (me, 0):
            raise NotPrivateError(
                f"{field}={path!r} is a symbolic link of another user ({_who(st)}): that user could point "
                f"it elsewhere at any time; use the directory itself (or a link of your own)",
                path, st.st_uid, stat.S_IMODE(st.st_mode))
        try:
            st = os.stat(path)
        except OSError as e:
            raise ConfigError(f"{field}={path!r} is a symbolic link that leads nowhere usable: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{field}={path!r} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != me and not (root_trusts_owner and me == 0):
        raise NotPrivateError(
            f"{field}={path!r} is owned by uid {st.st_uid} (mode {mode:04o}), not by this process's uid {me}: "
            f"that user can read what the store keeps there and plant records in it; use a directory of "
            f"your own (or, if nobody else wrote in it, chown -R {me} {path})", path, st.st_uid, mode)
    if mode & _GROUP_OTHER_WRITE:
        raise NotPrivateError(
            f"{field}={path!r} (owner uid {st.st_uid}, mode {mode:04o}) may be written by group or others, "
            f"who could have planted records in it; if nobody else wrote in it, chmod -R go-rwx {path} "
            f"(or remove it: the store makes it anew, empty, mode 0700)", path, st.st_uid, mode)
    return st


def ensure_private_dir(path: str, field: str, *, root_trusts_owner: bool = False) -> bool:
    """Make ``path`` (and the directories missing above it) mode 0700, or check the one that is
    there (:func:`check_private_dir`) and take group and other access away from it (the directory
    itself, not what it holds; only when this user owns it). True when it was made here. Raises
    as :func:`check_private_dir`, and ConfigError naming ``field`` when it cannot be made."""
    try:
        if make_private_dirs(path):
            return True
    except OSError as e:
        raise ConfigError(f"{field}={path!r}: cannot create the directory: {e.strerror}"
                          f"{' (a parent is a file)' if e.errno == errno.ENOTDIR else ''}") from None
    st = check_private_dir(path, field, root_trusts_owner=root_trusts_owner)
    mode = stat.S_IMODE(st.st_mode)
    if mode & _GROUP_OTHER and st.st_uid == os.geteuid():
        os.chmod(path, mode & ~_GROUP_OTHER)
        logger.warning("%s=%s: took group and other access away from the directory (mode %04o -> %04o)",
                       field, path, mode, mode & ~_GROUP_OTHER)
    return False


def tighten_tree(path: str, field: str) -> int:
    """Take group and other access away from ``path`` (a directory :func:`check_private_dir`
    passed) and from everything below it; returns how many entries changed, logged as one
    warning line when any did. Raises :class:`NotPrivateError` for an entry of another user or
    one group or others may write (nothing is changed below a refused directory; what was
    tightened before stays so). Symbolic links are neither followed nor changed. Entries that
    vanish meanwhile (another process of a shared directory) are skipped."""
    me = os.geteuid()
    changed = 0
    root_mode = stat.S_IMODE(os.stat(path).st_mode)
    if root_mode & _GROUP_OTHER:
        os.chmod(path, root_mode & ~_GROUP_OTHER)
        changed += 1
    todo = [path]
    while todo:
        d = todo.pop()
        try:
            entries = list(os.scandir(d))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"{field}={path!r}: cannot list {d}: {e.strerror}") from None
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid != me:
                raise NotPrivateError(
                    f"{field}={path!r}: {entry.path} is owned by uid {st.st_uid} (mode {mode:04o}), not by this "
                    f"process's uid {me}: another user wrote into the store's directory; remove it (or the "
                    f"whole directory: the store makes it anew)", entry.path, st.st_uid, mode)
            if stat.S_ISLNK(st.st_mode):
                continue
            if mode & _GROUP_OTHER_WRITE:
                raise NotPrivateError(
                    f"{field}={path!r}: {entry.path} (owner uid {st.st_uid}, mode {mode:04o}) may be written by "
                    f"group or others, who could have changed what it holds; if nobody else did, chmod -R "
                    f"go-rwx {path} (or remove {path}: the store makes it anew)", entry.path, st.st_uid, mode)
            if mode & _GROUP_OTHER:
                try:
                    os.chmod(entry.path, mode & ~_GROUP_OTHER)
                except FileNotFoundError:
                    continue
                changed += 1
            if stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)
    if changed:
        logger.warning("%s=%s: took group and other access away from %d files and directories an older "
                       "version left readable (now 0700 directories, 0600 files)", field, path, changed)
    return changed


def check_private_fd(fd: int, path: str, field: str, fix: str) -> None:
    """Refuse the file open at ``fd`` (a /dev/shm segment) unless this process's effective uid owns
    it and neither group nor others have any access: :class:`NotPrivateError` naming ``field``,
    ``path``, owner and mode, and ``fix``. fstat, so the file checked is the one open."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    me = os.geteuid()
    if st.st_uid != me:
        raise NotPrivateError(
            f"{field}: {path} exists, owned by uid {st.st_uid} (mode {mode:04o}), not by this process's uid {me}: "
            f"that user could read and write the store's memory; {fix}", path, st.st_uid, mode)
    if mode & _GROUP_OTHER:
        raise NotPrivateError(
            f"{field}: {path} exists with mode {mode:04o} (owner uid {st.st_uid}): group or others may open "
            f"it, and one that mapped it keeps its mapping; {fix}", path, st.st_uid, mode)

