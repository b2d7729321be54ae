"""store_backend.threads.Workers: the one owner of a component's background threads (start, bounded
join, errors logged and counted), tested on its own with real threads."""

from __future__ import annotations

import logging
import threading
import time

from store_backend.threads import Deadline, Workers


def test_started_threads_are_named_daemons_and_a_join_waits_for_them() -> None:
    w = Workers("test-owner")
    stop = threading.Event()
    threads = [w.start(stop.wait, 30, name=f"worker-{i}") for i in range(3)]
    assert [t.name for t in threads] == ["worker-0", "worker-1", "worker-2"]
    assert all(t.daemon and t.is_alive() for t in threads) and len(w.alive()) == 3
    stop.set()
    assert w.join(Deadline(10)) == 0
    assert w.alive() == [] and w.errors == 0


def test_a_thread_still_running_at_the_deadline_is_counted_and_logged_and_the_join_is_bounded(caplog) -> None:
    w = Workers("test-owner")
    stop = threading.Event()
    w.start(stop.wait, 30, name="stuck-worker")
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    try:
        assert w.join(Deadline(0.2)) == 1
        assert time.monotonic() - t0 < 2.0
        assert any("stuck-worker" in r.getMessage() and "test-owner" in r.getMessage() for r in caplog.records)
        assert [t.name for t in w.alive()] == ["stuck-worker"]  # not forgotten
    finally:
        stop.set()
        assert w.join(Deadline(10)) == 0


def test_an_exception_escaping_a_thread_is_logged_with_its_traceback_and_counted_once(caplog) -> None:
    told: list[int] = []
    w = Workers("test-owner", on_error=lambda: told.append(1))

    def broken() -> None:
        raise RuntimeError("injected")

    caplog.set_level(logging.ERROR)
    w.start(broken, name="broken-worker")
    assert w.join(Deadline(10)) == 0
    assert w.errors == 1 and told == [1]
    logged = [r for r in caplog.records if "broken-worker" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None and "injected" in str(logged[0].exc_info[1])


def test_a_thread_joining_its_own_owner_is_not_waited_for() -> None:
    w = Workers("test-owner")
    got: list[int] = []
    w.start(lambda: got.append(w.join(Deadline(30))), name="self-joiner")
    assert w.join(Deadline(10)) == 0
    assert got == [0]
