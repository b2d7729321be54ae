"""RemoveLog, each node's record of the pool's removes (what it gives a directory that lost its
tombstones back): the later time of a key wins, times carry the margin and never lie ahead of the
node's clock, removes are forgotten after their ttl and past max_entries (oldest first, counted),
bad arguments are refused; many threads adding at once lose nothing within the bound."""

from __future__ import annotations

import math
import threading

import pytest

from store_backend.pool.remove_log import RemoveLog


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_key_keeps_the_later_of_its_removal_times_and_the_ttl_left_counts_down() -> None:
    clock = _Clock()
    log = RemoveLog(ttl_s=100.0, wall_clock=clock)
    log.add(["a", "b"], 990.0)
    log.add(["a"], 980.0)  # earlier: a keeps 990
    log.add(["b"], 995.0)  # later: b moves to 995
    log.add(["c"])  # now
    keys, at, left = log.live()
    assert dict(zip(keys, at)) == {"a": 990.0, "b": 995.0, "c": 1000.0}
    assert dict(zip(keys, left)) == {"a": 90.0, "b": 95.0, "c": 100.0}
    assert len(log) == 3


def test_removes_are_forgotten_once_their_ttl_has_passed() -> None:
    clock = _Clock()
    log = RemoveLog(ttl_s=10.0, wall_clock=clock)
    log.add(["old"], 995.0)
    log.add(["new"], 1000.0)
    clock.now = 1004.5
    assert log.live()[0] == ["old", "new"]
    clock.now = 1005.0  # old's ttl is over
    assert log.live() == (["new"], [1000.0], [5.0])
    assert len(log) == 1
    clock.now = 1010.0
    assert log.live() == ([], [], [])
    assert len(log) == 0


def test_past_max_entries_the_oldest_added_are_forgotten_and_counted() -> None:
    log = RemoveLog(ttl_s=100.0, max_entries=3, wall_clock=_Clock())
    log.add(["k1", "k2", "k3"], 999.0)
    log.add(["k1"], 999.5)  # re-added: now the newest
    log.add(["k4", "k5"], 999.0)
    assert log.live()[0] == ["k1", "k4", "k5"]
    assert log.dropped == 2


def test_live_times_carry_the_margin_and_a_time_to_come_counts_as_now() -> None:
    """What live() gives is an upper bound of the directory's removal time (margin_s: this
    clock may be behind the directory's); a peer's time ahead of this clock is taken as now, so
    no tombstone is restored later than this node saw the remove (nor lives past ttl_s)."""
    log = RemoveLog(ttl_s=100.0, margin_s=1.5, wall_clock=_Clock())
    log.add(["past"], 990.0)
    log.add(["ahead"], 5000.0)  # a peer whose clock is more than an hour ahead
    assert log.live() == (["past", "ahead"], [991.5, 1001.5], [90.0, 100.0])


@pytest.mark.parametrize("kw, what", [
    ({"ttl_s": 0}, "ttl_s"), ({"ttl_s": -1.0}, "ttl_s"), ({"ttl_s": math.inf}, "ttl_s"),
    ({"ttl_s": "60"}, "ttl_s"), ({"max_entries": 0}, "max_entries"), ({"max_entries": True}, "max_entries"),
    ({"max_entries": 2.0}, "max_entries"), ({"margin_s": -1.0}, "margin_s"), ({"margin_s": math.nan}, "margin_s"),
])
def test_bad_settings_are_refused_by_name(kw: dict, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        RemoveLog(**kw)


@pytest.mark.parametrize("at", [math.nan, math.inf, -math.inf])
def test_a_removal_time_that_is_not_finite_is_refused_and_nothing_is_added(at: float) -> None:
    log = RemoveLog()
    with pytest.raises(ValueError, match="removed_at_s"):
        log.add(["k"], at)
    assert len(log) == 0


def test_threads_adding_at_once_lose_no_key_within_the_bound() -> None:
    clock = _Clock(2000.0)
    log = RemoveLog(ttl_s=2000.0, max_entries=4000, wall_clock=clock)
    start = threading.Barrier(8)

    def add(t: int) -> None:
        start.wait()
        for i in range(500):
            log.add([f"t{t}-{i}"], 900.0 + i)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    keys, at, _left = log.live()
    assert sorted(keys) == sorted(f"t{t}-{i}" for t in range(8) for i in range(500))
    assert all(a == 900.0 + int(k.split("-")[1]) for k, a in zip(keys, at))
    assert log.dropped == 0
