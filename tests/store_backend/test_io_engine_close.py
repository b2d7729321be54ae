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
        if req.offset == 0:
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
    assert bytes(bufs[0]) == b"x" * 4096  # the stuck read finished into memory that stayed valid
