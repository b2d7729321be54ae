"""Distinct hosts on one machine for the pool's tests: Linux network namespaces joined by veth pairs
to one bridge.

:class:`Hosts` makes ``n`` namespaces, each with one interface (``198.18.<x>.<i + 1>/24``, in the range
set aside for network tests) whose peer sits on a bridge in a namespace of its own, which also
carries the test's side (``.254``: where its Redis listens).
Nothing else routes between them: a node service started in host ``i`` (``ip netns exec``)
reaches its peers and Redis only over its veth, and :meth:`Hosts.cut` takes that link down (a real
partition: its packets go nowhere, connections time out rather than being refused), :meth:`Hosts.heal`
brings it back. The node's Unix socket is a file, and files are not per namespace, so engines
(and tests) on the machine still reach their node service while it is cut off: the case the
remove rule must survive.

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); :func:`require_netns` skips the test otherwise,
which the suite's conftest turns into a failure under CI. Everything made is deleted on close,
also after a failed start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check, timeout=30)


def require_netns() -> None:
    """Skip unless this process can make a network namespace (root, iproute2)."""
    if not os.path.exists(IP):
        pytest.skip("iproute2's ip is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    probe = f"mkvp{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


class Hosts:
    """``n`` namespaces on one bridge (see the module docstring); a context manager.

    The bridge lives in a namespace of its own (the "switch"), so no firewall of the test's
    namespace (br_netfilter hands bridged packets to iptables' FORWARD chain, which container
    hosts often DROP) sees the hosts' traffic; the test's side is one more veth into it."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        # A /24 of 198.18.0.0/15 (RFC 2544's range for network tests: no real network uses it),
        # from the tag; .254 is the test's side of the bridge.
        self.subnet = f"198.{18 + int(tag[0], 16) % 2}.{int(tag[1:3], 16)}"
        self.switch = f"mkv{tag}sw"
        self.names = [f"mkv{tag}h{i}" for i in range(n)]
        self.ips = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self.gateway = f"{self.subnet}.254"
        self._ports = [f"mkv{tag}p{i}" for i in range(n)]  # each host's port on the switch
        self._made: list[str] = []  # namespaces made so far (deleted by close)

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def start(self) -> Hosts:
        try:
            self._netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            # The test's side: a veth from here into the switch (deleted with the switch).
            here, there = f"mkv{self.tag}g", f"mkv{self.tag}gs"
            _ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", self.switch)
            _ip("addr", "add", f"{self.gateway}/24", "dev", here)
            _ip("link", "set", here, "up")
            _ip("-n", self.switch, "link", "set", there, "master", "br0", "up")
            for name, ip, port in zip(self.names, self.ips, self._ports):
                self._netns(name)
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in host ``i``."""
        return [IP, "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        """Partition host ``i``: its switch port goes down (it reaches nobody, nobody reaches it)."""
        _ip("-n", self.switch, "link", "set", self._ports[i], "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self._ports[i], "up")

    def close(self) -> None:
        """Delete every namespace made (their veths go with them), each tried even if one fails."""
        for name in reversed(self._made):
            try:
                _ip("netns", "del", name, check=False)
            except (OSError, subprocess.SubprocessError):
                pass
        self._made = []

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
