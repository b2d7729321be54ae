"""``make_io_engine``: the I/O engine for an ``ssd.io_engine`` config value (auto, io_uring, posix).

Who calls it: :func:`store_backend.ssd.factory.open_ssd_backend` and
:mod:`mooncake_kv.bench.raw_direct`, once per backend or benchmark, from the thread that opens it.
"""

from __future__ import annotations

import logging

from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.planning import DEFAULT_STAGING_BYTES
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.uring import io_uring_available
from store_backend.ssd.io.uring_engine import IoUringEngine

logger = logging.getLogger(__name__)

# The ssd.io_engine choices (the config's Literal names the same; a test keeps them equal).
IO_ENGINE_NAMES = ("auto", "io_uring", "posix")


def make_io_engine(kind: str = "auto", *, queue_depth: int = 32, threads: int = 2,
                   staging_bytes: int = DEFAULT_STAGING_BYTES) -> IoEngine:
    """An engine by config name: ``"auto"`` and ``"io_uring"`` use io_uring where this process may
    (falling back to POSIX, with a log line, where it may not), ``"posix"`` always uses POSIX."""
    if kind not in IO_ENGINE_NAMES:
        raise ValueError(f"io_engine must be auto, io_uring or posix, got {kind!r}")
    if kind != "posix":
        ok, why = io_uring_available()
        if ok:
            return IoUringEngine(queue_depth=queue_depth, staging_bytes=staging_bytes)
        log = logger.warning if kind == "io_uring" else logger.info
        log("io_uring unavailable (%s); using POSIX preadv/pwritev with %d threads", why, threads)
    return PosixEngine(threads=threads, staging_bytes=staging_bytes)
