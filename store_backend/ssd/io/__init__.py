"""Batched file I/O for the SSD tier: io_uring through raw syscalls, POSIX preadv/pwritev as fallback.

Who calls it: the SSD backends (the store's offload/promotion workers and readers on the get path,
any thread) and :mod:`mooncake_kv.bench.raw_direct`. Both engines are thread-safe: the io_uring
engine gives every calling thread a private ring (``threading.local``), the POSIX engine runs a
batch on a bounded thread pool it starts on first use.

The modules, each imported by name (this package re-exports nothing, so using the POSIX engine or
the helpers never loads the io_uring code):

- :mod:`.requests`: :class:`IoRequest`, ``ALIGN`` and the alignment helpers, ``aligned_buffer``,
  ``probe_direct_io``, ``fsync_dir``; used by the backends and by everything below.
- :mod:`.base`: the :class:`IoEngine` Protocol and the ``Completion`` callback type.
- :mod:`.planning`: how one request becomes syscalls (alignment, bounce memory, iovec split) and
  how it runs synchronously; shared by both engines.
- :mod:`.uring`: the raw io_uring ring (ctypes syscalls, mmap of the SQ/CQ rings) and
  ``io_uring_available``.
- :mod:`.uring_engine`: :class:`IoUringEngine`. :mod:`.posix_engine`: :class:`PosixEngine`.
- :mod:`.factory`: ``make_io_engine``, the engine for an ``ssd.io_engine`` config value.
"""
