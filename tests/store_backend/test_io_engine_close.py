"""The POSIX engine's close() is bounded: a pool thread stuck in a read (a hung disk, injected by
blocking the engine's per-request step) is reported by name and left behind, never waited for
forever."""

from __future__ import annotations

import logging
import os
import threading
import time

from store_backend.ssd.io import posix_engine
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.requests import IoRequest


def test_close_with_a_stuck_pool_thread_is_bounded_and_reports_it(tmp_path, monkeypatch, caplog) -> None:
    real = posix_engine.execute_sync
    entered, release = threading.Event(), threading.Event()

    def stuck_once(req, write, alloc):  # noqa: ANN001, ANN202
        # The second request: both are submitted by the time it runs, so close() cannot refuse
        # one of them (the reader would then leave before the stuck read ends).
        if req.offset == 4096:
            entered.set()
            release.wait(30)
        return real(req, write, alloc)

    monkeypatch.setattr(posix_engine, "execute_sync", stuck_once)
    monkeypatch.setattr(posix_engine, "CLOSE_TIMEOUT_S", 0.5, raising=False)
    fd = os.open(tmp_path / "data", os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"x" * 8192, 0)
    eng = PosixEngine(threads=2)
    bufs = [bytearray(4096), bytearray(4096)]
    reader = threading.Thread(target=lambda: eng.read([IoRequest(fd, 0, [bufs[0]]), IoRequest(fd, 4096, [bufs[1]])]),
                              daemon=True)
    reader.start()
    try:
        assert entered.wait(10)
        caplog.set_level(logging.WARNING)
        closer = threading.Thread(target=eng.close, daemon=True)
        t0 = time.monotonic()
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "close() waited for the stuck read"
        assert time.monotonic() - t0 < 1.5
        assert any("kv-posix-io" in r.getMessage() and "did not stop" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        reader.join(10)
        os.close(fd)
    assert not reader.is_alive()
    assert bytes(bufs[0]) == b"x" * 4096
    assert bytes(bufs[1]) == b"x" * 4096  # the stuck read finished into memory that stayed valid


def test_a_stuck_pool_thread_keeps_its_staging_for_the_bounces_it_still_needs(tmp_path, monkeypatch) -> None:
    """O_DIRECT with unaligned buffers: every read goes through a bounce buffer in the pool
    thread's staging area. Both pool threads hang in the syscall (their bounces allocated) when
    close() gives up on them; the two requests still queued behind them run after release, from
    the same stagings, and every byte arrives."""
    real_preadv = os.preadv
    release = threading.Event()
    in_syscall = threading.Semaphore(0)

    def hung_disk(fd, bufs, offset, *a):  # noqa: ANN001, ANN002, ANN202
        if threading.current_thread().name.startswith("kv-posix-io") and not release.is_set():
            in_syscall.release()
            release.wait(30)
        return real_preadv(fd, bufs, offset, *a)

    path = tmp_path / "data"
    content = os.urandom(4 * 4096)
    path.write_bytes(content)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs) has no bounces to keep
        import pytest
        pytest.skip(f"no O_DIRECT here: {e}")
    monkeypatch.setattr(os, "preadv", hung_disk)
    eng = PosixEngine(threads=2)
    bufs = [bytearray(100) for _ in range(4)]  # unaligned length: bounced
    got: list[object] = []

    def read() -> None:
        try:
            got.append(eng.read([IoRequest(fd, i * 4096, [b]) for i, b in enumerate(bufs)]))
        except Exception as e:  # noqa: BLE001
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(2):
            assert in_syscall.acquire(timeout=10), "the pool threads never reached the disk"
        # All four submitted (two wait in the pool's queue) before close() stops new submissions.
        deadline = time.monotonic() + 10
        while eng._pool is not None and eng._pool._work_queue.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)  # poll interval; the loop has a deadline
        assert eng.close(timeout_s=0.3) == 2
    finally:
        release.set()
        reader.join(10)
        os.close(fd)
    assert got == [[100, 100, 100, 100]], got
    for i, b in enumerate(bufs):
        assert bytes(b) == content[i * 4096:i * 4096 + 100]


def test_a_single_request_after_close_is_refused_as_closed(tmp_path) -> None:
    """One request runs inline in the caller's thread, with that thread's staging area, which
    close() released: it must say the engine is closed, not fail on released memory."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDWR)
    eng = PosixEngine(threads=2)
    try:
        buf = bytearray(100)  # under O_DIRECT: bounced through this thread's staging
        assert eng.read([IoRequest(fd, 0, [buf])]) == [100]
        assert eng.close() == 0
        import pytest
        for write in (False, True):
            with pytest.raises(RuntimeError, match="io engine is closed"):
                (eng.write if write else eng.read)([IoRequest(fd, 0, [bytearray(100)])])
    finally:
        os.close(fd)
