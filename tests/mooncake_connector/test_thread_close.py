"""Owned threads of the connector core stop within their close() timeout, as a whole, and a thread
still running then (a store call that hangs) is logged by name and reported, not forgotten.

The hang is injected around a real store: a wrapper whose one method blocks until released."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake_connector.client import KVClient
from mooncake_connector.epoch import EpochSweeper
from mooncake_connector.lookup_client import LookupClient
from mooncake_connector.lookup_service import LookupServer, socket_path
from store_backend.store import TieredStore
from tests.store_backend.node.server_harness import wait_until


class Hanging:
    """A real store whose ``method`` blocks until ``release`` is set."""

    def __init__(self, inner: TieredStore, method: str) -> None:
        self.inner, self.method = inner, method
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):  # noqa: ANN204
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def hang(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.entered.set()
            self.release.wait(30)
            return real(*args, **kwargs)
        return hang


@pytest.fixture
def store():
    s = TieredStore({"dram": {"capacity_bytes": "4MiB"}}).start()
    yield s
    s.close()


def _warned(caplog, name: str) -> bool:
    return any(r.levelno == logging.WARNING and name in r.getMessage() and "did not stop" in r.getMessage()
               for r in caplog.records)


def test_client_close_with_a_hanging_save_is_bounded_and_reports_it(store, caplog) -> None:
    hanging = Hanging(store, "put")
    client = KVClient(hanging, name="kv-io-test").start()
    try:
        client.save(["a"], [np.ones(64, np.uint8)])
        assert hanging.entered.wait(10)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        assert client.close(timeout_s=0.5) == 1
        assert time.monotonic() - t0 < 1.0
        assert _warned(caplog, "kv-io-test")
    finally:
        hanging.release.set()


def test_lookup_server_close_with_a_hanging_lookup_is_bounded_and_reports_it(store, tmp_path: Path,
                                                                            caplog) -> None:
    hanging = Hanging(store, "exists")
    server = LookupServer(hanging, socket_path("hang", 0, str(tmp_path))).start()
    asker = LookupClient(server.path, timeout_s=10)
    t = threading.Thread(target=lambda: asker.exists(["a"]), daemon=True)
    t.start()
    try:
        assert hanging.entered.wait(10)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        assert server.close(timeout_s=0.5) == 1
        assert time.monotonic() - t0 < 1.0
        assert _warned(caplog, "kv-lookup-conn")
    finally:
        hanging.release.set()
        t.join(10)
        asker.close()


def test_sweeper_close_with_a_hanging_sweep_is_bounded_by_one_timeout_and_reports_it(store, caplog) -> None:
    hanging = Hanging(store, "keys")
    sweeper = EpochSweeper(hanging)  # type: ignore[arg-type]
    sweeper.sweep(["0" * 32])
    try:
        assert hanging.entered.wait(10)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        stuck = sweeper.close(timeout_s=0.5)
        elapsed = time.monotonic() - t0
        assert elapsed < 0.9, f"close(timeout_s=0.5) took {elapsed:.2f} s"  # was: the wait, then a full join
        assert stuck == 1
        assert _warned(caplog, "kv-epoch-sweep")
    finally:
        hanging.release.set()


class Broken:
    """A real store whose ``method`` misbehaves: raises, or answers something of the wrong type."""

    def __init__(self, inner: TieredStore, method: str, answer: object = None) -> None:
        self.inner, self.method, self.answer = inner, method, answer

    def __getattr__(self, name: str):  # noqa: ANN204
        if name != self.method:
            return getattr(self.inner, name)

        def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.answer is None:
                raise RuntimeError(f"injected {self.method} failure")
            return self.answer
        return broken


def test_a_failed_sweep_is_logged_and_reported_to_the_owner(store, caplog) -> None:
    errors: list[int] = []
    sweeper = EpochSweeper(Broken(store, "keys"), on_error=lambda: errors.append(1))  # type: ignore[arg-type]
    caplog.set_level(logging.ERROR)
    sweeper.sweep(["0" * 32])
    assert sweeper.wait_idle(10)
    assert sweeper.close(timeout_s=5) == 0
    assert errors == [1] and sweeper.errors == 1
    assert any(r.exc_info is not None and "old cache epochs" in r.getMessage() for r in caplog.records)


def test_a_serving_thread_killed_by_a_bug_is_logged_and_reported_to_the_owner(store, tmp_path: Path,
                                                                              caplog) -> None:
    errors: list[int] = []
    # exists() answering a non-integer: the reply cannot be encoded (a bug, not a peer's fault).
    server = LookupServer(Broken(store, "exists", answer=object()), socket_path("bug", 0, str(tmp_path)),
                          on_error=lambda: errors.append(1)).start()
    asker = LookupClient(server.path, timeout_s=2)
    caplog.set_level(logging.ERROR)
    try:
        asker.exists(["a"])  # the connection is closed under it: a transport failure, a miss
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert errors and len(errors) == server.errors  # the client may ask again once, on a new connection
        assert any(r.exc_info is not None and "lookup connection" in r.getMessage() for r in caplog.records)
    finally:
        asker.close()
        assert server.close(timeout_s=5) == 0


class FailsOnce:
    """A real store whose ``keys`` raises the first time only (a transient failure)."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner, self.calls = inner, 0

    def keys(self, prefix: str = "") -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected keys failure")
        return self.inner.keys(prefix)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def _raising_callback() -> None:
    raise RuntimeError("injected on_error failure")


def test_a_sweeper_whose_error_callback_raises_keeps_sweeping(store, caplog) -> None:
    digest = "0" * 32
    assert all(st.ok for st in store.put([f"{digest}/a"], [np.ones(64, np.uint8)]))
    sweeper = EpochSweeper(FailsOnce(store), on_error=_raising_callback)  # type: ignore[arg-type]
    caplog.set_level(logging.ERROR)
    try:
        sweeper.sweep([digest])
        assert sweeper.wait_idle(10) and sweeper.errors == 1
        sweeper.sweep([digest])  # the thread survived the callback: this sweep runs
        assert sweeper.wait_idle(5), "the sweeper thread died with its error callback"
        assert sweeper.removed == 1 and store.keys() == []
        assert any("error callback" in r.getMessage() and r.exc_info is not None for r in caplog.records)
    finally:
        assert sweeper.close(timeout_s=5) == 0


def test_a_sweep_that_fails_after_close_is_not_counted(store, caplog) -> None:
    """close() left a hanging sweep behind and the owner closed the store: the sweep's later
    StoreClosedError is the shutdown, not a worker error."""
    errors: list[int] = []
    hanging = Hanging(store, "keys")
    sweeper = EpochSweeper(hanging, on_error=lambda: errors.append(1))  # type: ignore[arg-type]
    before = set(threading.enumerate())
    sweeper.sweep(["0" * 32])
    assert hanging.entered.wait(10)
    [thread] = [t for t in threading.enumerate() if t not in before and t.name == "kv-epoch-sweep"]
    assert sweeper.close(timeout_s=0.2) == 1
    store.close()
    hanging.release.set()  # the listing now meets the closed store
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert errors == [] and sweeper.errors == 0


def test_a_lookup_server_whose_error_callback_raises_keeps_serving(store, tmp_path: Path, monkeypatch,
                                                                   caplog) -> None:
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    broken = Broken(store, "exists", answer=object())
    server = LookupServer(broken, socket_path("cb", 0, str(tmp_path)), on_error=_raising_callback).start()
    asker = LookupClient(server.path, timeout_s=2)
    caplog.set_level(logging.ERROR)
    try:
        asker.exists(["a"])
        deadline = time.monotonic() + 5
        while not server.errors and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert server.errors >= 1
        broken.method = "none"  # exists() works again: the server still answers
        assert all(st.ok for st in store.put(["a"], [np.ones(64, np.uint8)]))
        assert asker.exists(["a"]) == 1
        # Only the connection just answered is served: the failed ones' threads are over, and one
        # that died would have met the excepthook on its way out.
        wait_until(lambda: server.live_connection_threads <= 1, 10,
                   "the failed connections' threads ended")
        assert died == [], f"a serving thread died with its error callback: {died}"
        assert any("error callback" in r.getMessage() and r.exc_info is not None for r in caplog.records)
    finally:
        asker.close()
        assert server.close(timeout_s=5) == 0
