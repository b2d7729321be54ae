"""Real Redis processes for tests: a server, a replica of it, a Sentinel, on 127.0.0.1 at random ports.

Each is the OS package's ``redis-server`` binary (``.ci/run`` installs it through
``scripts/setup.sh``), started in its own temporary directory, killed (SIGKILL) by ``kill()`` and
stopped by ``stop()``. :func:`require_redis` skips a test where the binary is missing, which the
suite's conftest turns into a failure under CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import proclogs
from tests.ports import free_port  # noqa: F401  (the suite's one allocator; re-exported)

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def require_redis() -> str:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("redis-server is not installed (scripts/setup.sh all installs it)")
    return REDIS_SERVER




def _answers(port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            if password:
                s.sendall(f"AUTH {password}\r\n".encode())
                s.recv(64)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisProcess:
    """One ``redis-server`` (plain, replica or sentinel) on 127.0.0.1:``port``."""

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 replica_of: int | None = None, sentinel_of: tuple[str, int] | None = None,
                 extra: list[str] | None = None, workdir: str | None = None) -> None:
        self.binary = require_redis()
        self.port = port or free_port()
        self.password = password
        self.replica_of = replica_of
        self.sentinel_of = sentinel_of
        self.extra = list(extra or [])
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="mkv-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _config(self) -> str:
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}", "save \"\"", "appendonly no",
                 "protected-mode no", f"logfile {self.dir / 'redis.log'}"]
        if self.password and self.sentinel_of is None:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        if self.replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {self.replica_of}")
        if self.sentinel_of is not None:
            name, master_port = self.sentinel_of
            lines += [f"sentinel monitor {name} 127.0.0.1 {master_port} 1",
                      f"sentinel down-after-milliseconds {name} 1000",
                      f"sentinel failover-timeout {name} 5000",
                      f"sentinel parallel-syncs {name} 1"]
            if self.password:
                lines.append(f"sentinel auth-pass {name} {self.password}")
        return "\n".join(lines + self.extra) + "\n"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        conf = self.dir / ("sentinel.conf" if self.sentinel_of else "redis.conf")
        conf.write_text(self._config())
        args = [self.binary, str(conf)] + (["--sentinel"] if self.sentinel_of else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        proclogs.note_log(self.proc, self.dir / "redis.log")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}: "
                                   f"{(self.proc.stderr.read() if self.proc.stderr else b'').decode()[-2000:]}"
                                   f" {self.log_tail()}")
            if _answers(self.port, None if self.sentinel_of else self.password):
                return self
            time.sleep(0.05)  # poll interval; the loop has a deadline
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (nothing is saved: the data is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def restart_empty(self) -> RedisProcess:
        """SIGKILL and start again on the same port with no data."""
        self.stop()
        return self.start()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
