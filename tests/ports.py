"""The suite's one allocator of loopback TCP ports: :func:`free_port`, :func:`free_ports`.

A port is one nothing is bound to when it is handed out, below the kernel's ephemeral range where
that range leaves room (the kernel hands ephemeral ports to outgoing connections, which could take
a port between its allocation and the bind of the server it is for), and never handed out twice by
this process (two servers a test starts one after the other cannot get the same port). Under
pytest-xdist each worker draws from its own slice of the range, so two workers never hand out the
same port either.
"""

from __future__ import annotations

import os
import random
import socket
import threading

from mooncake_kv.bench.ports import below_ephemeral, bindable

_given: set[int] = set()
_lock = threading.Lock()


def _range() -> tuple[int, int]:
    """This process's slice of the ports below the ephemeral range (all of it outside xdist)."""
    low, high = below_ephemeral()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        step = (high - low) // int(count)
        low = low + step * int(worker[2:])
        high = low + step
    return low, high


def free_port() -> int:
    """A loopback TCP port nothing is bound to now and this process has not handed out before."""
    low, high = _range()
    with _lock:
        for _ in range(200 if high - low > 1000 else 0):
            port = random.randrange(low, high)
            if port not in _given and bindable(port):
                _given.add(port)
                return port
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    raise RuntimeError("no free loopback port found")


def free_ports(*names: str) -> dict[str, int]:
    """One distinct :func:`free_port` per name."""
    return {name: free_port() for name in names}
