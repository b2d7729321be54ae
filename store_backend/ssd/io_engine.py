"""Former import point of the SSD tier's I/O engines; the code lives in :mod:`store_backend.ssd.io`.

Re-exports the public names this module used to define, for importers not yet moved to the
modules of :mod:`store_backend.ssd.io` (``requests``, ``base``, ``factory``, ``uring``,
``uring_engine``, ``posix_engine``). New code imports from those modules directly.
"""

from __future__ import annotations

from store_backend.ssd.io.base import Completion, IoEngine
from store_backend.ssd.io.factory import make_io_engine
from store_backend.ssd.io.planning import DEFAULT_STAGING_BYTES, IOV_MAX
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.requests import (ALIGN, IoRequest, align_down, align_up, aligned_buffer, buffer_address,
                                           fsync_dir, is_direct, probe_direct_io)
from store_backend.ssd.io.uring import io_uring_available
from store_backend.ssd.io.uring_engine import DEFAULT_MAX_INFLIGHT_BYTES, IoUringEngine

__all__ = ["ALIGN", "DEFAULT_MAX_INFLIGHT_BYTES", "DEFAULT_STAGING_BYTES", "IOV_MAX", "Completion", "IoEngine",
           "IoRequest", "IoUringEngine", "PosixEngine", "align_down", "align_up", "aligned_buffer", "buffer_address",
           "fsync_dir", "io_uring_available", "is_direct", "make_io_engine", "probe_direct_io"]
