"""What an I/O request is, and the alignment and file helpers the SSD backends share.

Lives here: :class:`IoRequest` (one contiguous file range and the caller's buffers), ``ALIGN`` (the
O_DIRECT block), ``align_up``/``align_down``, ``aligned_buffer`` (page-aligned memory),
``buffer_address``, ``is_direct``, ``probe_direct_io`` and ``fsync_dir``.

Who calls it: the SSD backends (:mod:`store_backend.ssd.bucket`, ``offset``, ``file_per_key``,
``record``) on the store's workers and get-path readers, and the engines of this package. Plain
functions without shared state: any thread.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from store_backend.private import open_private
from store_backend.types import Buffer, byte_view

ALIGN = 4096  # O_DIRECT alignment used for addresses, lengths and file offsets


class IoRequest(NamedTuple):
    """One contiguous file range: ``buffers`` (in file order) are read into or written from."""

    fd: int
    offset: int
    buffers: Sequence[Buffer]


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) & ~(a - 1)


def align_down(n: int, a: int = ALIGN) -> int:
    return n & ~(a - 1)


def aligned_buffer(nbytes: int) -> memoryview:
    """Zeroed, page-aligned writable memory (an anonymous mapping freed with its last view)."""
    return memoryview(mmap.mmap(-1, max(ALIGN, align_up(nbytes))))[:nbytes]


def buffer_address(buf: Buffer) -> int:
    """Address of a buffer's first byte (read-only buffers included)."""
    mv = byte_view(buf)
    if mv.nbytes == 0:
        return 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def probe_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs before 6.6, ramfs: no)."""
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = open_private(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        ok = False
    else:
        os.close(fd)
        ok = True
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return ok


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
