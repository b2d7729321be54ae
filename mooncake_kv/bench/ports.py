"""The benches' one way to pick a loopback TCP port for a server they start: :func:`free_port`
(the test suite's allocator, tests/ports.py, takes :func:`below_ephemeral` and :func:`bindable`
from here).

A port from ``bind(0)`` is an ephemeral one, which the kernel also hands to outgoing connections:
between the bench closing its probe socket and the server binding the port, any connection on the
host can take it ("Address already in use"). The port is therefore drawn below the kernel's
ephemeral range when that range leaves room, and checked bindable when it is handed out.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_BELOW_EPHEMERAL = (20000, 32768)


def below_ephemeral() -> tuple[int, int]:
    """[low, high): loopback ports below the kernel's ephemeral range (the range's start read from
    /proc; 32768 when it cannot be read). Empty or narrow when that range starts low."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = _BELOW_EPHEMERAL[1]
    return _BELOW_EPHEMERAL[0], min(_BELOW_EPHEMERAL[1], start)


def bindable(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing is bound to now, outside the ephemeral range where possible."""
    low, high = below_ephemeral()
    if high - low > 1000:
        for _ in range(200):
            port = random.randrange(low, high)
            if bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
