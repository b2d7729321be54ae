"""BatchWorker on its own: FIFO order, several threads taking batches at once, one idle pass at a time."""

from __future__ import annotations

import threading
import time

from store_backend.engine import BatchWorker
from tests.store_backend.node.server_harness import wait_until


def test_items_are_handled_in_the_order_submitted_and_handed_back_work_goes_first() -> None:
    seen: list[int] = []
    gate, entered = threading.Event(), threading.Event()

    def handle(batch: list[int]) -> None:
        entered.set()
        gate.wait(10)
        seen.extend(batch)

    w: BatchWorker[int] = BatchWorker("test-fifo", handle, queue_max=16, batch_max=2)
    w.start()
    try:
        w.submit([1, 2])  # taken at once; blocks on the gate
        assert entered.wait(10)
        w.submit([5, 6])
        assert w.submit([3, 4], front=True) == 0  # handed back: ahead of what is queued, in order
        gate.set()
        assert w.wait_idle(10)
        assert seen == [1, 2, 3, 4, 5, 6]
    finally:
        gate.set()
        assert w.close(timeout_s=5)


def test_a_full_queue_refuses_the_last_items_also_at_its_front() -> None:
    seen: list[int] = []
    w: BatchWorker[int] = BatchWorker("test-full", seen.extend, queue_max=3)  # not started: all queued
    try:
        assert w.submit([1, 2]) == 0
        assert w.submit([3, 4, 5], front=True) == 2  # 3 fits; 4 and 5 do not
        assert w.depth == 3
        w.start()  # the queue, in its order
        assert w.wait_idle(10)
        assert seen == [3, 1, 2]
    finally:
        assert w.close(timeout_s=5)


def test_several_threads_handle_batches_at_once() -> None:
    inside: list[int] = []
    both = threading.Barrier(2, timeout=10)

    def handle(batch: list[int]) -> None:
        inside.extend(batch)
        both.wait()  # returns only once two batches are in flight together

    w: BatchWorker[int] = BatchWorker("test-threads", handle, queue_max=8, batch_max=1, threads=2)
    w.start()
    try:
        w.submit([1, 2])
        assert w.wait_idle(10) and sorted(inside) == [1, 2]
        assert w.running and not w.busy
    finally:
        assert w.close(timeout_s=5)
    assert not w.running


def test_the_idle_hook_runs_on_one_thread_at_a_time() -> None:
    running = 0
    most = 0
    passes = 0
    lock = threading.Lock()

    def hook() -> None:
        nonlocal running, most, passes
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)  # the hook's simulated work: a second pass meanwhile would overlap it
        with lock:
            running -= 1
            passes += 1

    w: BatchWorker[int] = BatchWorker("test-hook", lambda batch: None, queue_max=8, idle_hook=hook,
                                      idle_interval_s=0.001, threads=3)
    w.start()
    try:
        assert w.wait_for(passes=w.kick(), timeout_s=10)
        wait_until(lambda: passes >= 10, 10, "ten hook passes")
    finally:
        assert w.close(timeout_s=5)
    assert passes >= 2 and most == 1


def test_close_joins_every_thread_and_on_exit_runs_once_per_thread() -> None:
    exits: list[str] = []
    w: BatchWorker[int] = BatchWorker("test-exit", lambda batch: None, queue_max=8, threads=3,
                                      on_exit=lambda: exits.append(threading.current_thread().name))
    w.start()
    w.submit(range(6))
    assert w.close(drain=True, timeout_s=5)
    assert exits == ["test-exit"] * 3 and not w.running
