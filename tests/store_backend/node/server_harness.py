"""Shared pieces of the node service's tests: a config in a short private directory, a service on a
thread of the test process or in a subprocess (``python -m store_backend.node serve``), and a client
that speaks raw frames (so these tests do not depend on the NodeClient)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from store_backend.node import protocol as p
from store_backend.node.fdpass import recv_fd
from store_backend.node.launch import spawn_service
from store_backend.node.segment import map_segment
from store_backend.node.server import NodeService
from tests.processes import stop

REPO = Path(__file__).resolve().parents[3]


def short_dir() -> str:
    """A fresh 0700 directory with a short path (an AF_UNIX address holds 107 bytes)."""
    return tempfile.mkdtemp(prefix="mkn-", dir="/tmp")


def throwaway_uid() -> int:
    """A uid that no account has (no passwd entry) and no process runs as, for acting as another
    user (``setpriv --reuid``, ``os.setuid``: both take a bare number). Only root can become it."""
    import pwd

    taken = {pw.pw_uid for pw in pwd.getpwall()}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    taken.update(int(u) for u in line.split()[1:])
        except (OSError, ValueError):
            continue
    uid = 1_900_000_000 + os.getpid() % 100_000
    while uid in taken:
        uid += 1
    return uid


def service_config(directory: str, **over: Any) -> dict[str, Any]:
    """A small service: 16 MiB DRAM under a name of its own, socket in ``directory``, no metrics."""
    cfg: dict[str, Any] = {
        "socket": os.path.join(directory, "node.sock"),
        "store": {"dram": {"capacity_bytes": 16 << 20, "shm_name": f"mkn-test-{uuid.uuid4().hex[:12]}"}},
        "metrics": None,
        "drain_timeout_s": 1.0,
    }
    for k, v in over.items():
        if k == "store":
            cfg["store"] = {**cfg["store"], **v}
        else:
            cfg[k] = v
    return cfg


def segments_named(shm_name: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(shm_name + "-"))


def unlink_free_segments(shm_name: str) -> None:
    """Remove segments of ``shm_name`` that no live service holds (what a SIGKILL left)."""
    for name in segments_named(shm_name):
        path = os.path.join("/dev/shm", name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def service_thread(cfg: dict[str, Any], **kwargs: Any) -> Iterator[NodeService]:
    svc = NodeService(cfg, **kwargs).run_in_thread()
    try:
        yield svc
    finally:
        svc.stop(timeout_s=30)


def wait_until(check: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last: {got!r})")
        time.sleep(0.02)  # poll interval; the loop has a deadline


class Raw:
    """One connection to the service speaking frames by hand. ``hello()`` maps the segment when
    ``want_segment``; ``ask(msg)`` sends one request (its id set) and returns the reply."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.reader = p.FrameReader(self.sock, p.Reply)
        self.timeout_s = timeout_s
        self.next_id = 1
        self.welcome: p.Welcome | None = None
        self.mapping: mmap.mmap | None = None
        self.fd: int | None = None

    def hello(self, want_segment: bool = True, name: str = "test", version: int = p.PROTOCOL_VERSION) -> p.Frame:
        self.sock.sendall(p.encode(p.Hello(self._id(), version, os.getpid(), name, want_segment)))
        if not want_segment:
            reply = self.reader.read(self.timeout_s)
        else:
            data, fd = recv_fd(self.sock, 1 << 16)
            replies = self.reader.decoder.feed(data)
            reply = replies[0] if replies else self.reader.read(self.timeout_s)
            self.fd = fd
        if isinstance(reply, p.Welcome):
            self.welcome = reply
            if self.fd is not None:
                self.mapping = map_segment(self.fd, reply.segment_bytes, reply.segment_id)
        return reply

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def ask(self, msg: p.Frame) -> p.Frame:
        msg = type(msg)(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "id": self._id()})
        self.sock.sendall(p.encode(msg))
        reply = self.reader.read(self.timeout_s)
        assert reply is not None, f"the service closed the connection after {msg!r}"
        if not isinstance(reply, (p.Error, p.Draining)):
            assert reply.id == msg.id, (reply, msg)
        return reply

    def read(self, timeout_s: float | None = None) -> p.Frame | None:
        return self.reader.read(self.timeout_s if timeout_s is None else timeout_s)

    def put(self, key: str, data: bytes) -> None:
        """reserve -> write through the mapping -> commit, asserting each step worked."""
        slots = self.ask(p.Reserve(0, [key], [len(data)]))
        assert isinstance(slots, p.Slots) and slots.grants[0].status == 0, slots
        g = slots.grants[0]
        assert self.mapping is not None
        self.mapping[g.offset:g.offset + len(data)] = data
        st = self.ask(p.Commit(0, [g.token]))
        assert isinstance(st, p.Statuses) and list(st.values) == [0], st

    def get(self, key: str) -> bytes | None:
        """lease -> copy out -> release; None when the lease was not OK."""
        slots = self.ask(p.Lease(0, [key]))
        assert isinstance(slots, p.Slots), slots
        g = slots.grants[0]
        if g.status != 0:
            return None
        assert self.mapping is not None
        out = bytes(self.mapping[g.offset:g.offset + g.nbytes])
        rel = self.ask(p.Release(0, [g.token]))
        assert isinstance(rel, p.Bools) and rel.values == [True], rel
        return out

    def closed_by_peer(self, timeout_s: float = 5.0) -> bool:
        """Whether the service closes the connection within ``timeout_s`` (frames before are read)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if self.reader.read(max(0.01, end - time.monotonic())) is None:
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True
            except p.FrameError:
                return True
            except TimeoutError:
                return False
        return False

    def close(self) -> None:
        """Idempotent."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.sock.close()


class ServiceProcess:
    """``python -m store_backend.node serve`` in a subprocess, its log in ``directory``."""

    def __init__(self, cfg: dict[str, Any], directory: str, *args: str, prefix: Sequence[str] = ()) -> None:
        """``prefix``: a command the service runs under (``ip netns exec NAME``: another host)."""
        self.cfg = cfg
        self.config_path = os.path.join(directory, "node.yaml")
        # 0600: a config holding a secret (pool.secret, a password in a Redis url) must be private.
        with os.fdopen(os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            yaml.safe_dump(cfg, f)
        self.log_path = os.path.join(directory, "node.log")
        self.log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = spawn_service(self.config_path, self.log, *args, prefix=prefix, env=env, cwd=REPO,
                                  new_session=False)
        self.socket_path = cfg["socket"]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited with {self.proc.returncode}: {self.log_text()}")
            try:
                c = Raw(self.socket_path, timeout_s=5.0)
                try:
                    if isinstance(c.hello(want_segment=False), p.Welcome):
                        return
                finally:
                    c.close()
            except OSError:
                pass
            time.sleep(0.05)  # poll interval; the loop has a deadline
        raise AssertionError(f"service not ready in {timeout_s} s: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        return self.proc.wait(timeout_s)

    def close(self, *, unlink_leftovers: bool = True) -> None:
        """Stop it (SIGTERM, then SIGKILL after 30 s) and remove what a kill leaves in /dev/shm."""
        stop(self.proc)
        self.log.close()
        if unlink_leftovers:
            unlink_free_segments(self.cfg["store"]["dram"]["shm_name"])


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def cleanup_dir(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


# The command loop of a client in another process: each stdin line is a JSON string of Python, an
# expression (its value is printed back as JSON) or statements (``v["out"]`` is printed back).
_LOOP = """
def _serve(names):
    for line in sys.stdin:
        code = json.loads(line)
        try:
            try:
                out = eval(code, names)
            except SyntaxError:
                exec(code, names)
                out = names["v"].pop("out", None)
            print(json.dumps(out if isinstance(out, (int, str, list, type(None), bool, float, dict)) else repr(out)),
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps(f"raised {type(e).__name__}: {e}"), flush=True)
"""

_OTHER = """
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from store_backend.node import protocol as p
from store_backend.types import Status
from tests.store_backend.node.server_harness import Raw
""" + _LOOP + """
c = Raw(sys.argv[1])
print(json.dumps(type(c.hello(name="other")).__name__), flush=True)
_serve({"c": c, "p": p, "Status": Status, "Raw": Raw, "v": {}, "os": os, "time": time, "signal": signal})
"""


class OtherProcess:
    """A client in a process of its own (the service keeps tokens per process): ``run(expr)``
    evaluates ``expr`` there over its connection ``c`` (a :class:`Raw`, hello done) and ``p``
    (the protocol) and returns the result as JSON gives it back. ``kill()`` SIGKILLs it."""

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _OTHER, path, str(REPO)], cwd=str(REPO), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid
        assert self._read() == "Welcome"

    def _read(self) -> Any:
        import json

        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the other process exited ({self.proc.poll()})"
        return json.loads(line)

    def run(self, code: str) -> Any:
        """Run ``code`` there (an expression: its value; statements: what they put in ``v["out"]``).
        An exception there comes back as the string ``"raised <type>: <message>"``."""
        import json

        self.proc.stdin.write(json.dumps(textwrap.dedent(code).strip()) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


_CLIENT = """
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[2])
import numpy as np
from store_backend.node import protocol as p
from store_backend.node.client import NodeClient
from store_backend.types import Status
""" + _LOOP + """
c = NodeClient(sys.argv[1], **json.loads(sys.argv[3])).start()
print(json.dumps(os.getpid()), flush=True)
_serve({"c": c, "v": {}, "np": np, "p": p, "Status": Status, "os": os, "signal": signal, "time": time})
"""


class ClientProcess(OtherProcess):
    """A :class:`~store_backend.node.client.NodeClient` in a process of its own: ``run(expr)``
    evaluates ``expr`` there with ``c`` (the client), ``v`` (a dict kept between calls: views,
    reservations), ``np``, ``p`` and ``Status``; :attr:`pid` is its pid."""

    def __init__(self, path: str, **client: Any) -> None:
        import json

        self.proc = subprocess.Popen([sys.executable, "-c", _CLIENT, path, str(REPO), json.dumps(client)],
                                     cwd=str(REPO), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self._read()
        assert isinstance(self.pid, int), self.pid
