"""The suite's one allocator of loopback TCP ports: :func:`free_port`, :func:`free_ports`.

A port is one nothing is bound to when it is handed out, below the kernel's ephemeral range where
that range leaves room (the kernel hands ephemeral ports to outgoing connections, which could take
a port between its allocation and the bind of the server it is for), and never handed out twice by
this process (two servers a test starts one after the other cannot get the same port).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_PORTS_BELOW_EPHEMERAL = (20000, 32768)
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _PORTS_BELOW_EPHEMERAL[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing is bound to now and this process has not handed out before."""
    low, high = _PORTS_BELOW_EPHEMERAL[0], min(_PORTS_BELOW_EPHEMERAL[1], _ephemeral_low())
    with _lock:
        for _ in range(200 if high - low > 1000 else 0):
            port = random.randrange(low, high)
            if port not in _given and _bindable(port):
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
