"""The store's "ask outside the lock, re-check after" rule (coherence.Ticket), table-tested with no
store: a ticket is taken, then something happens to a key (or to another key), then the ticket is
asked whether what was learned of the key outside the lock still stands."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from store_backend.coherence import EvictionClock, RemovalTracker, Ticket

Step = Callable[[RemovalTracker, EvictionClock], None]


def _nothing(r: RemovalTracker, c: EvictionClock) -> None:
    pass


def _remove_begins(r: RemovalTracker, c: EvictionClock) -> None:
    r.begin("k")


def _remove_begins_and_ends(r: RemovalTracker, c: EvictionClock) -> None:
    r.begin("k")
    r.end("k", deleted=True)


def _remove_ends_undeleted(r: RemovalTracker, c: EvictionClock) -> None:
    r.begin("k")
    r.end("k", deleted=False)  # stuck: hidden until a later deletion succeeds


def _other_key_removed(r: RemovalTracker, c: EvictionClock) -> None:
    r.begin("other")
    r.end("other", deleted=True)


def _touched(r: RemovalTracker, c: EvictionClock) -> None:
    r.touch("k")  # a change that does not hide (reads in flight keep no copy)


def _evicted_below(r: RemovalTracker, c: EvictionClock) -> None:
    c.stamp("k")


def _other_key_evicted(r: RemovalTracker, c: EvictionClock) -> None:
    c.stamp("other")


# (what happens after the ticket, removed, changed, evicted)
CASES: list[tuple[Step, bool, bool, bool]] = [
    (_nothing, False, False, False),
    (_remove_begins, True, False, False),
    (_remove_begins_and_ends, True, True, False),
    (_remove_ends_undeleted, True, False, False),
    (_other_key_removed, False, False, False),
    (_touched, True, True, False),
    (_evicted_below, False, False, True),
    (_other_key_evicted, False, False, False),
]


@pytest.mark.parametrize(("after", "removed", "changed", "evicted"), CASES, ids=[c[0].__name__ for c in CASES])
def test_a_ticket_says_what_happened_to_its_key_after_it_was_taken(
        after: Step, removed: bool, changed: bool, evicted: bool) -> None:
    r, c = RemovalTracker(), EvictionClock()
    t = Ticket(r, c)
    after(r, c)
    assert (t.removed("k"), t.changed("k"), t.evicted("k")) == (removed, changed, evicted)


@pytest.mark.parametrize(("before", "removed", "changed", "evicted"), CASES, ids=[c[0].__name__ for c in CASES])
def test_what_happened_before_the_ticket_does_not_count_unless_the_key_is_still_hidden(
        before: Step, removed: bool, changed: bool, evicted: bool) -> None:
    r, c = RemovalTracker(), EvictionClock()
    before(r, c)
    t = Ticket(r, c)
    # Only a removal still under way (or stuck) hides the key from a ticket taken after it began.
    assert (t.removed("k"), t.changed("k"), t.evicted("k")) == (r.hidden("k"), False, False)


def test_a_ticket_is_conservative_for_keys_the_trackers_forgot() -> None:
    r, c = RemovalTracker(remembered_max=4), EvictionClock(remembered_max=4)
    t = Ticket(r, c)
    for n in range(10):  # past the bound: the oldest keys' numbers are forgotten
        r.begin(f"k{n}")
        r.end(f"k{n}", deleted=True)
        c.stamp(f"k{n}")
    # k0 was changed after the ticket and then forgotten: still reported as changed (never trusted).
    assert t.removed("k0") and t.changed("k0") and t.evicted("k0")
    later = Ticket(r, c)
    assert not later.removed("k0") and not later.evicted("k0")
