"""What both ends of the TCP pool transport share (:mod:`store_backend.pool.tcp_server`,
:mod:`store_backend.pool.tcp_client`): socket tuning, the stream count for this host, the payload
checksum, address parsing, ``sendfile`` with a deadline and the pure split of a batch over streams.

Every frame after the handshake is tagged with the connection's session key and every payload
checksum is keyed by it (:class:`~store_backend.pool.frames.Session`): a relay without the secret
cannot change a request, a reply or a payload unnoticed. Checksums are computed inline, piece by piece (256 KiB) as each piece is received or just before
it is sent, while it is in the CPU cache: measured here that costs 0.33-0.40 CPU-s per GB on the
reader against 0.5 with a hash thread reading the whole object again afterwards (xxhash releases
the GIL, but the second pass over DRAM costs more than it overlaps). The sendfile path cannot hash
inline (the bytes never pass through the server), so it hashes on the server's hash threads. Every call is bounded by its
``timeout_s`` (one deadline for the whole call; every socket wait gets what is left of it).
Thread-safe; no lock is held across I/O.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Sequence

import xxhash

from store_backend.pool.transport import TransportError

logger = logging.getLogger(__name__)

DEFAULT_SOCKET_BUFFER_BYTES = 4 << 20
# Keys per request frame: 512 keys of the longest (1 KiB) keep a header well under its 1 MiB cap.
KEYS_PER_FRAME = 512
# A batch smaller than this per extra stream is not split (a connection's round trip costs more).
MIN_STREAM_BYTES = 1 << 20
# Usable CPUs below which one batch goes over a single connection (see auto_streams).
MIN_CPUS_FOR_TWO_STREAMS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_streams(cpus: int | None = None) -> int:
    """Connections one batch is split over when none is configured: 1 on a host with fewer than
    MIN_CPUS_FOR_TWO_STREAMS usable CPUs (``cpus``, default :func:`usable_cpus`), else 2.

    Measured on a 2-CPU host (a reader and a server on loopback): a second stream cost the reader
    0.31-0.55 CPU-s per GB against 0.19-0.29 for one (GIL hand-offs and four busy threads on two
    CPUs) and moved 0.76-0.91 of a plain socket's rate where one stream moved 0.88-1.04
    (docs/PERFORMANCE.md, the pool section). Streams overlap only where there are CPUs to run
    them."""
    n = usable_cpus() if cpus is None else cpus
    return 1 if n < MIN_CPUS_FOR_TWO_STREAMS else 2


def checksum(view: memoryview, seed: int = 0) -> int:
    """xxh3-64 of ``view`` with ``seed`` (releases the GIL while it hashes)."""
    return xxhash.xxh3_64_intdigest(view, seed)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as (host, port); TransportError naming the address."""
    if not isinstance(address, str) or ":" not in address:
        raise TransportError(f"address must be 'host:port', got {address!r}")
    host, _, port_s = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise TransportError(f"address {address!r}: port {port_s!r} is not a number") from None
    if not host or not 0 < port < 65536:
        raise TransportError(f"address {address!r}: needs a host and a port in 1..65535")
    return host, port


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY (headers must not wait for Nagle) and larger socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass


def time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def sendfile_range(sock: socket.socket, fd: int, offset: int, count: int, deadline: float) -> None:
    """Send ``count`` bytes of file ``fd`` from ``offset`` (``os.sendfile``: the kernel copies from
    the page cache, nothing passes through this process), bounded by ``deadline``."""
    out = sock.fileno()
    poller = None
    while count > 0:
        try:
            k = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            k = -1
        if k == 0:
            raise OSError(f"sendfile: the segment ended at offset {offset} with {count} bytes left")
        if k > 0:
            offset += k
            count -= k
            continue
        if poller is None:
            poller = select.poll()
            poller.register(out, select.POLLOUT)
        if not poller.poll(max(1, int(time_left(deadline) * 1000))):
            time_left(deadline)


# -- server ---------------------------------------------------------------------------------------


def split_by_bytes(sizes: Sequence[int], streams: int, min_stream_bytes: int = MIN_STREAM_BYTES) -> list[range]:
    """Contiguous index ranges of ``sizes``, at most ``streams`` of them, of about equal bytes
    (a stream gets at least ``min_stream_bytes``). Pure."""
    n = len(sizes)
    total = sum(sizes)
    k = max(1, min(streams, n, total // max(1, min_stream_bytes)))
    if k == 1:
        return [range(n)] if n else []
    out: list[range] = []
    start, acc, target = 0, 0, total / k
    for i, s in enumerate(sizes):
        acc += s
        if acc >= target * (len(out) + 1) and len(out) < k - 1 and i + 1 < n:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, n))
    return out
