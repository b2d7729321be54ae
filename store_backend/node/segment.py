"""The arena's shared-memory segment as the node service names, passes on and cleans up.

The store makes the segment (``TieredStore(config, fresh_segment=True)``: a new ``/dev/shm`` file,
0600, a fresh inode at every start, leftovers of a killed owner unlinked), describes it
(``store.segment()``, a :class:`store_backend.slots.SegmentInfo`) and opens descriptors of it for
passing (``store.open_segment_fd()``, never the one holding its lock). Here:

- :func:`segment_id`: which file it is (``"<st_dev>:<st_ino>"``, what ``welcome.segment_id`` says).
- :func:`unlink_if_same` (service, at stop): the segment's path goes, if it still names that inode.
- :func:`map_segment` (a client): maps a passed descriptor after checking it is the segment
  ``welcome`` named, pages faulted in up front.

Functions block on the file system only (fstat, unlink, mmap); call from any thread.
"""

from __future__ import annotations

import errno
import mmap
import os

from store_backend.slots import SegmentInfo


class SegmentMismatchError(OSError):
    """A descriptor that is not the segment it was said to be."""


def segment_id(info: SegmentInfo) -> str:
    """``"<st_dev>:<st_ino>"``, the identity ``welcome.segment_id`` carries."""
    return f"{info.dev}:{info.ino}"


def unlink_if_same(info: SegmentInfo) -> bool:
    """Unlink ``info.path`` if it still names ``info``'s inode (idempotent; True when it did). A
    client's mapping of it stays valid; the pages go back when the last mapping closes."""
    try:
        st = os.stat(info.path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (info.dev, info.ino):
        return False
    try:
        os.unlink(info.path)
    except FileNotFoundError:
        return False
    return True


def map_segment(fd: int, nbytes: int, expect_id: str, *, populate: bool = True) -> mmap.mmap:
    """Map the segment passed as ``fd`` (read-write, shared) after checking it is ``expect_id``
    (:class:`SegmentMismatchError` otherwise). ``populate``: fault every page in now
    (``MAP_POPULATE``), so first copies run at memcpy speed. The caller keeps ``fd`` (the mapping
    does not need it) and owns the mapping."""
    st = os.fstat(fd)
    got = f"{st.st_dev}:{st.st_ino}"
    if got != expect_id:
        raise SegmentMismatchError(errno.ESTALE, f"the passed segment is {got}, the service said {expect_id}")
    if st.st_size < nbytes:
        raise SegmentMismatchError(errno.EINVAL, f"the passed segment holds {st.st_size} bytes, "
                                                 f"the service said {nbytes}")
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
