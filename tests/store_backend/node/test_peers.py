"""How the service tells that a client process exited (:class:`ProcessWatch`): a pidfd, else the
start time in /proc; a watch that can do neither is unusable (the service refuses that client),
never "exited" (which would free the memory of a process still writing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from store_backend.node import peers
from store_backend.node.peers import ProcessWatch, boot_time_s


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def _watch_sees_the_exit(pidfd: bool) -> None:
    """A watch on a live child: usable, not exited (with a pidfd when ``pidfd``); exited once the
    child is killed."""
    child = _child()
    try:
        w = ProcessWatch(child.pid, boot_time_s())
        assert w.usable and (w.fd is not None or not pidfd) and not w.exited()
        child.kill()
        child.wait(10)
        assert w.exited()
        w.close()
    finally:
        child.kill()


def test_a_live_process_is_watched_and_its_exit_is_seen() -> None:
    _watch_sees_the_exit(pidfd=False)


def test_with_proc_unreadable_a_pidfd_alone_watches_the_process(monkeypatch) -> None:
    """/proc mounted with hidepid (start times unreadable): a pidfd still tells, so the live process
    does not count as exited (before, it did at once: its slots would have been freed)."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd on this platform")
    monkeypatch.setattr(peers, "start_time_s", lambda pid: None)
    _watch_sees_the_exit(pidfd=True)


def test_with_neither_a_pidfd_nor_proc_the_watch_is_unusable_not_exited(monkeypatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "pidfd_open not implemented")

    monkeypatch.setattr(peers.os, "pidfd_open", no_pidfd)
    monkeypatch.setattr(peers, "start_time_s", lambda pid: None)
    child = _child()
    try:
        w = ProcessWatch(child.pid, boot_time_s())
        assert not w.usable and not w.exited()
        w.close()
    finally:
        child.kill()
        child.wait(10)


def test_without_a_pidfd_an_unreadable_proc_never_counts_as_an_exit(monkeypatch) -> None:
    """Watching /proc (no pidfd), a read that fails for another reason than the process being gone
    (out of descriptors) says nothing: the process is not exited, its slots stay held."""
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "pidfd_open not implemented")

    monkeypatch.setattr(peers.os, "pidfd_open", no_pidfd)
    child = _child()
    try:
        w = ProcessWatch(child.pid, boot_time_s())
        assert w.usable and w.fd is None and not w.exited()

        def out_of_fds(pid: int) -> float:
            raise peers.ProcUnreadable(24, "Too many open files")

        monkeypatch.setattr(peers, "start_time_s", out_of_fds)
        assert not w.exited()
        monkeypatch.undo()
        child.kill()
        child.wait(10)
        assert w.exited()
    finally:
        child.kill()


def test_a_pidfd_numbered_past_fd_setsize_is_polled() -> None:
    """The service raises its descriptor limit past 1024: a pidfd numbered above it still works."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1100 or not hasattr(os, "pidfd_open"):
        pytest.skip("needs pidfd and a descriptor limit above 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    child = _child()
    filler = []
    try:
        while (fd := os.open("/dev/null", os.O_RDONLY)) < 1030:
            filler.append(fd)
        filler.append(fd)
        w = ProcessWatch(child.pid, boot_time_s())
        assert w.fd is not None and w.fd >= 1024 and not w.exited()
        child.kill()
        child.wait(10)
        assert w.exited()
        w.close()
    finally:
        for fd in filler:
            os.close(fd)
        child.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
