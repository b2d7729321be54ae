"""Passing the arena segment's fd to another process over a Unix socket, and who may attach.

The two-process test is real: a separate Python process receives the fd of a /dev/shm file whose
path is already unlinked (so it can only reach the bytes through the fd), maps it, checks the
bytes, writes into it, and the parent sees the write in its own mapping.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from store_backend.framing import READ_PIECE_BYTES
from store_backend.node import protocol as p
from store_backend.node.fdpass import (
    FdPassError,
    PeerAccessError,
    PeerCredentials,
    check_peer,
    fd_identity,
    may_attach,
    peer_credentials,
    recv_fd,
    reopen_fd,
    send_fd,
)

REPO = Path(__file__).resolve().parents[3]
SEG_BYTES = 1 << 20

CHILD = textwrap.dedent("""
    import hashlib, mmap, os, socket, sys
    from store_backend.node.fdpass import fd_identity, peer_credentials, recv_fd
    sock = socket.socket(fileno=int(sys.argv[1]))
    creds = peer_credentials(sock)
    data, fd = recv_fd(sock, 4096)
    assert fd is not None, "no fd came"
    m = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    digest = hashlib.sha256(m[:]).hexdigest()
    m[-4:] = b"CHLD"  # a write the parent must see through its own mapping
    m.flush()
    reply = f"{data.decode()} {fd_identity(fd)} {digest} {creds.pid} {creds.uid} {creds.gid}"
    sock.sendall(reply.encode())
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the parent to look before unmapping
""")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_child_process_maps_the_same_segment_through_the_passed_fd() -> None:
    path = f"/dev/shm/mooncake-kv-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)  # from here on, only the fd reaches the bytes
    os.ftruncate(fd, SEG_BYTES)
    ours = mmap.mmap(fd, SEG_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    ours[:] = os.urandom(SEG_BYTES)
    want = hashlib.sha256(ours[:]).hexdigest()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno())], pass_fds=[child.fileno()],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    try:
        child.close()
        parent.settimeout(60)
        passed = reopen_fd(fd)  # its own open file description, as the service passes it
        try:
            send_fd(parent, b"welcome", passed)
        finally:
            os.close(passed)
        reply = b""
        while chunk := parent.recv(4096):
            reply += chunk
        assert reply, proc.stderr.read().decode() if proc.poll() is not None else "no reply"
        data, ident, digest, pid, uid, gid = reply.decode().split()
        assert data == "welcome"
        assert ident == fd_identity(fd)  # the very file
        assert digest == want  # the same bytes
        assert (int(pid), int(uid), int(gid)) == (os.getpid(), os.geteuid(), os.getegid())
        assert ours[-4:] == b"CHLD"  # the child's write landed in our mapping: one shared segment
        parent.sendall(b"x")
        assert proc.wait(60) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        parent.close()
        ours.close()
        os.close(fd)


def test_the_peer_credentials_are_the_connecting_process() -> None:
    a, b = socket.socketpair()
    try:
        assert peer_credentials(a) == PeerCredentials(os.getpid(), os.geteuid(), os.getegid())
    finally:
        a.close()
        b.close()


def test_a_message_without_an_fd_gives_none_and_end_of_stream_empty_bytes() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(b"hello")
        assert recv_fd(b, 64) == (b"hello", None)
        a.close()
        assert recv_fd(b, 64) == (b"", None)
    finally:
        b.close()


@pytest.mark.parametrize("nfds", [2, 3])
def test_more_fds_than_expected_are_refused_and_none_leak(tmp_path: Path, nfds: int) -> None:
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_RDWR, 0o600) for i in range(nfds)]
    a, b = socket.socketpair()
    try:
        before = _fd_count()
        socket.send_fds(a, [b"x"], files)
        with pytest.raises(FdPassError, match="expected at most 1 fd"):
            recv_fd(b, 64)
        assert _fd_count() == before
    finally:
        a.close()
        b.close()
        for f in files:
            os.close(f)


def test_send_fd_needs_a_byte_to_carry_it(tmp_path: Path) -> None:
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="at least one byte"):
            send_fd(a, b"", 0)
    finally:
        a.close()
        b.close()


def test_a_reopened_fd_is_its_own_open_file_so_the_lock_stays_behind(tmp_path: Path) -> None:
    """A dup shares the flock of the original; a reopened fd does not (a client holding the
    service's lock fd would otherwise keep the next service from starting)."""
    lock_fd = os.open(tmp_path / "seg", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dup = os.dup(lock_fd)
        fcntl.flock(dup, fcntl.LOCK_EX | fcntl.LOCK_NB)  # same open file description: "already" held
        os.close(dup)
        other = reopen_fd(lock_fd)
        try:
            assert fd_identity(other) == fd_identity(lock_fd)
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        os.close(lock_fd)


def test_the_access_rule_is_same_user_or_root() -> None:
    assert may_attach(1000, 1000) and may_attach(0, 1000) and not may_attach(1001, 1000)
    check_peer(PeerCredentials(1, 1000, 1000), 1000, "/run/x.sock")
    check_peer(PeerCredentials(1, 0, 0), 1000, "/run/x.sock")
    with pytest.raises(PeerAccessError, match=r"uid 1001 \(pid 7\) may not attach to the node service of uid 1000 "
                                              r"at /run/x.sock"):
        check_peer(PeerCredentials(7, 1001, 1001), 1000, "/run/x.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_process_of_another_user_is_refused_by_its_real_credentials() -> None:
    """A forked child drops to uid 65534 and connects (abstract socket: no file permissions in the
    way); the kernel's credentials of that connection fail the check."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0mooncake-kv-test-{uuid.uuid4().hex}"
    server.bind(name)
    server.listen(1)
    server.settimeout(30)
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(name)
            c.recv(1)
            code = 0
        finally:
            os._exit(code)
    try:
        conn, _ = server.accept()
        try:
            creds = peer_credentials(conn)
            assert (creds.pid, creds.uid) == (pid, 65534)
            refused = "uid 65534 .* may not attach to the node service of uid 0 at sock"
            with pytest.raises(PeerAccessError, match=refused):
                check_peer(creds, os.geteuid(), "sock")
        finally:
            conn.close()
    finally:
        server.close()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_welcome_frame_and_the_segment_fd_arrive_together(tmp_path: Path) -> None:
    """How the service answers ``hello``: the encoded ``welcome`` with the fd riding on its first
    byte; the client reads that first piece with recv_fd and feeds it to its frame decoder."""
    seg = os.open(tmp_path / "seg", os.O_CREAT | os.O_RDWR, 0o600)
    a, b = socket.socketpair()
    try:
        welcome = p.Welcome(1, p.PROTOCOL_VERSION, os.getpid(), 1, fd_identity(seg), 0, 4096,
                            p.MAX_FRAME_BYTES, 3600.0, ["dram"])
        send_fd(a, p.encode(welcome) + p.encode(p.Ack(2)), seg)
        data, fd = recv_fd(b, READ_PIECE_BYTES)
        assert fd is not None
        try:
            assert p.MessageDecoder(p.Reply).feed(data) == [welcome, p.Ack(2)]
            assert fd_identity(fd) == welcome.segment_id and fd != seg
        finally:
            os.close(fd)
    finally:
        a.close()
        b.close()
        os.close(seg)
