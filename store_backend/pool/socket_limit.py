"""The raw limit a Python TCP stream reaches on this machine: a plain ``sendall`` -> ``recv_into``
between two processes over loopback (or over a link to a network namespace), what the pool
transport is measured against.

:func:`raw_socket_limit_gbps` starts one sender process (multiprocessing, spawn), connects to it
on 127.0.0.1 and, per object size, times receiving a batch of ``total_bytes`` in objects of that
size, sent from distinct buffers into distinct preallocated buffers, as a batched get moves them
(one reused buffer would stay in the CPU cache and measure the cache, not the path); no hashing,
no headers: the ceiling. Blocking; owns its child process
and ends it before returning. Used by the pool benchmark (``mooncake_kv.bench.pool``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import socket
import struct
import time
from collections.abc import Sequence

_REQ = struct.Struct(">QQ")  # object size, object count; (0, 0) ends the sender
_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move this process into the network namespace ``name`` (``ip netns add NAME``; needs root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _sender(port: int, buffer_bytes: int, host: str = "127.0.0.1", netns: str | None = None) -> None:
    if netns is not None:
        _enter_netns(netns)
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        batches: dict[tuple[int, int], list[memoryview]] = {}
        while True:
            head = sock.recv(_REQ.size, socket.MSG_WAITALL)
            if len(head) < _REQ.size:
                return
            size, count = _REQ.unpack(head)
            if count == 0:
                return
            batch = batches.get((size, count))
            if batch is None:
                batch = batches[(size, count)] = [memoryview(bytearray(b"\x01" * size)) for _ in range(count)]
            for data in batch:
                sock.sendall(data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("sender closed early")
        got += k


def raw_socket_limit_gbps(sizes_bytes: Sequence[int], total_bytes: int, *, repeats: int = 3,
                          buffer_bytes: int = 0, host: str = "127.0.0.1",
                          sender_netns: str | None = None) -> dict[int, float]:
    """GB/s (1e9 bytes/s) of one plain Python stream per object size in ``sizes_bytes``, moving
    ``total_bytes`` (at least one object) per repeat; the best of ``repeats``. ``buffer_bytes``:
    SO_SNDBUF/SO_RCVBUF to set (0: the kernel's default, as a plain socket has). ``host``: the
    address this process listens on and the sender connects to; ``sender_netns``: the network
    namespace the sender runs in (the stream then crosses whatever link joins it to ``host``)."""
    ctx = multiprocessing.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen(1)
        proc = ctx.Process(target=_sender, args=(listener.getsockname()[1], buffer_bytes, host, sender_netns),
                           daemon=True)
        proc.start()
        try:
            listener.settimeout(60)
            sock, _ = listener.accept()
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if buffer_bytes:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
                sock.settimeout(120)
                out: dict[int, float] = {}
                for size in sizes_bytes:
                    count = max(1, total_bytes // size)
                    bufs = [memoryview(bytearray(size)) for _ in range(count)]
                    for b in bufs:
                        b[::4096] = b"\x01" * len(range(0, size, 4096))  # fault the pages in before timing
                    best = 0.0
                    for rep in range(repeats + 1):  # the first round makes the sender's batch: not timed
                        t0 = time.perf_counter()
                        sock.sendall(_REQ.pack(size, count))
                        for buf in bufs:
                            _recv_into(sock, buf)
                        if rep == 0:
                            continue
                        best = max(best, size * count / (time.perf_counter() - t0) / 1e9)
                    out[size] = best
                sock.sendall(_REQ.pack(0, 0))
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return out
