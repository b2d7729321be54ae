"""The residency event bus alone: order and numbering, a full queue (dropped, counted, one gap),
subscriber errors, and a publisher never held up by a slow subscriber."""

from __future__ import annotations

import threading
import time

import pytest

from store_backend.residency import ResidencyBus, ResidencyEvent
from store_backend.threads import Deadline

pytestmark = pytest.mark.timeout(60)


def ev(key: str, kind: str = "stored") -> ResidencyEvent:
    return ResidencyEvent(kind, key, "dram", 1)  # type: ignore[arg-type]


@pytest.fixture
def bus():
    b = ResidencyBus(queue_max=8, batch_max=3)
    b.start()
    yield b
    b.close(Deadline(5))


def test_events_arrive_in_order_numbered_on_the_bus_thread(bus) -> None:
    got: list[ResidencyEvent] = []
    threads: set[str] = set()

    def sub(events: list[ResidencyEvent]) -> None:
        threads.add(threading.current_thread().name)
        got.extend(events)

    bus.subscribe(sub)
    for i in range(0, 12, 4):  # 12 events, never more than 8 queued at once
        bus.publish([ev(f"k{j}") for j in range(i, i + 4)])
        assert bus.wait_idle(5)
    assert [e.key for e in got] == [f"k{j}" for j in range(12)]
    assert [e.seq for e in got] == list(range(1, 13))
    assert threads == {"kv-events"}
    assert bus.dropped == 0


def test_a_full_queue_drops_counts_and_signals_one_gap_after_what_was_queued(bus) -> None:
    release = threading.Event()
    entered = threading.Event()
    log: list[object] = []

    def slow(events: list[ResidencyEvent]) -> None:
        entered.set()
        release.wait(10)
        log.extend(e.key for e in events)

    bus.subscribe(slow, on_gap=lambda: log.append("GAP"))
    bus.publish([ev("first")])
    assert entered.wait(5)  # the subscriber holds the first batch; the queue (8) fills behind it
    t0 = time.monotonic()
    bus.publish([ev(f"q{i}") for i in range(12)])
    bus.publish([ev("late")])
    assert time.monotonic() - t0 < 0.5  # a slow subscriber never holds a publisher up
    assert bus.dropped == 5
    release.set()
    assert bus.wait_idle(5)
    assert log == ["first", *[f"q{i}" for i in range(8)], "GAP"]
    bus.publish([ev("after")])
    assert bus.wait_idle(5)
    assert log[-1] == "after" and log.count("GAP") == 1


def test_a_failing_subscriber_is_counted_and_the_others_still_get_everything(bus) -> None:
    got: list[str] = []

    def bad(events: list[ResidencyEvent]) -> None:
        raise RuntimeError("subscriber bug")

    bus.subscribe(bad)
    bus.subscribe(lambda events: got.extend(e.key for e in events))
    bus.publish([ev("a"), ev("b")])
    bus.publish([ev("c")])
    assert bus.wait_idle(5)
    assert got == ["a", "b", "c"]
    assert bus.subscriber_errors >= 1


def test_unsubscribe_and_no_subscribers_queue_nothing(bus) -> None:
    got: list[str] = []
    unsubscribe = bus.subscribe(lambda events: got.extend(e.key for e in events))
    bus.publish([ev("a")])
    assert bus.wait_idle(5)
    unsubscribe()
    bus.publish([ev(f"x{i}") for i in range(100)])  # more than the queue holds: nobody listens
    assert bus.depth == 0 and bus.dropped == 0 and got == ["a"]


def test_close_is_bounded_with_a_stuck_subscriber() -> None:
    b = ResidencyBus(queue_max=8)
    b.start()
    stuck = threading.Event()
    b.subscribe(lambda events: stuck.wait(30))
    b.publish([ev("a")])
    t0 = time.monotonic()
    assert b.close(Deadline(0.5)) is False  # said, not hidden
    assert time.monotonic() - t0 < 3
    stuck.set()
