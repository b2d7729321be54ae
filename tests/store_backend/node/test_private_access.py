"""Another user gets nothing of a running node service: it can neither read nor write nor plant
anything in its socket directory or its SSD directory, open its segment (read-only or read-write),
or connect to its socket. Real uids: processes dropped to a throwaway uid (one no account has and
no process runs as: a fork that calls ``setuid``, or ``setpriv``), with the service under a
directory anyone may pass through, so the service's own modes are what keep them out. Needs root
(CI runs as root; a skip there is a failure)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store_backend.node.server_harness import service_config, service_thread, throwaway_uid

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")]

SETPRIV = shutil.which("setpriv")


@pytest.fixture
def open_base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="mkn-priv-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_other(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    if SETPRIV is None:
        pytest.skip("needs setpriv (util-linux)")
    return subprocess.run([SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


def connect_as_other(uid: int, path: str) -> int:
    """errno of a connect to ``path`` by a child running as ``uid`` (0: it connected)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only os and socket calls until _exit
        code = 255
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(path)
                code = 0
            except OSError as e:
                code = e.errno or 255
            os.write(w, bytes([code]))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    os.waitpid(pid, 0)
    assert len(got) == 1, "the child reported nothing"
    return got[0]


def test_another_user_reaches_nothing_of_a_running_service(open_base):
    other = throwaway_uid()
    sock_dir = open_base / "sock"
    ssd = open_base / "ssd"
    cfg = service_config(str(sock_dir), store={"ssd": {"path": str(ssd), "backend": "bucket", "io_engine": "posix",
                                                       "capacity_bytes": 16 << 20}})
    old = os.umask(0o277)  # a umask that would strip the owner's own bits: the modes hold anyway
    try:
        with service_thread(cfg) as svc:
            assert svc.segment is not None
            seg = svc.segment.path
            assert stat.S_IMODE(os.stat(sock_dir).st_mode) & 0o077 == 0
            assert stat.S_IMODE(os.stat(svc.socket_path).st_mode) & 0o077 == 0
            assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(ssd).st_mode) == 0o700
            assert as_other(other, "ls", str(open_base)).returncode == 0  # the way in is open
            assert as_other(other, "id", "-u").stdout.strip() == str(other)  # it really runs as that uid
            denied = [as_other(other, "ls", str(sock_dir)), as_other(other, "cat", seg),
                      as_other(other, "ls", str(ssd)),
                      # writes: plant a file in either directory, open the segment read-write
                      as_other(other, "sh", "-c", ': > "$0"', str(sock_dir / "planted")),
                      as_other(other, "sh", "-c", ': > "$0"', str(ssd / "planted")),
                      as_other(other, "sh", "-c", ': > "$0"', str(sock_dir / "node.sock")),
                      as_other(other, "sh", "-c", 'exec 3<>"$0"', seg),
                      as_other(other, "sh", "-c", 'exec 3>>"$0"', seg)]
            for d in denied:
                assert d.returncode != 0 and "Permission denied" in d.stderr, d
            assert connect_as_other(other, svc.socket_path) == errno.EACCES
            assert "planted" not in os.listdir(sock_dir) and "planted" not in os.listdir(ssd)
    finally:
        os.umask(old)
