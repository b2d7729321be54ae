"""Bookkeeping that keeps ``remove`` airtight and ``flush`` honest while bytes move between tiers.

Owned by :class:`store_backend.store.TieredStore` and called only under its lock: not thread-safe
itself, and never does I/O.

Removal. The store deletes an object's SSD copy outside its lock, and background work (an offload
write, a promotion read) may have begun before the remove did. So:

- a key is *hidden* on SSD from the moment ``remove`` takes it until its SSD copy is deleted, and
  for as long as an offload write that began before the remove may still land a copy (the offload
  deletes that copy when it finishes). Reads, lookups, promotions and new SSD writes treat a hidden
  key as absent on SSD; a key whose deletion failed stays hidden until a later one succeeds;
- the start and the end of every removal (and of every owed deletion) take a number from one
  increasing sequence, so work that looked a key up on SSD outside the lock can ask at commit time
  whether the key's visibility changed in between. The end counts too: an offload that began
  before a remove may land a copy after the remove returned; a lookup that saw that copy just
  before it was deleted (and the key made visible again) must not be trusted.

Evictions below. An SSD backend evicts on its own and reports it (``set_eviction_listener``); the
store numbers each report per key (:class:`EvictionClock`), so an offload that wrote a key outside
the lock marks it persisted only when no eviction of it was reported meanwhile, and remembers
what is believed stored below (:class:`KnownBelow`: dropped from DRAM while persisted, found there
at open, by a put or by a read) so that admission's "is the parent
stored?" is answered from memory, never by asking the SSD tier under the lock.

Loss. Objects dropped from DRAM before they reached SSD are remembered (bounded, oldest forgotten
first) with the reason and the number of their loss, so that ``flush`` can say which objects put
before it are not persisted, without reporting losses of objects put after it began.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from itertools import islice

_REMEMBERED_MAX = 1 << 16


class RemovalTracker:
    """Hidden keys and removal numbers (see the module docstring)."""

    def __init__(self, remembered_max: int = _REMEMBERED_MAX) -> None:
        self._hidden: dict[str, int] = {}  # key -> deletions of its SSD copy still owed
        self._stuck: set[str] = set()  # keys whose SSD copy could not be deleted
        self._seq = 0
        self._changed_at: dict[str, int] = {}  # key -> number of its latest change, oldest first
        self._floor = 0  # a key no longer remembered counts as removed at this number
        self._max = remembered_max

    def generation(self) -> int:
        """The number of the latest visibility change; compare with :meth:`changed_since` later."""
        return self._seq

    def changed_since(self, key: str, generation: int) -> bool:
        """Whether a removal of ``key`` began, or an owed deletion of its SSD copy ended, after
        ``generation`` was read (conservative for keys forgotten to keep the table bounded)."""
        return self._changed_at.get(key, self._floor) > generation

    def _stamp(self, key: str) -> None:
        self._seq += 1
        self._changed_at.pop(key, None)  # re-inserted last, so the dict stays oldest-first
        self._changed_at[key] = self._seq
        if len(self._changed_at) > self._max:
            for old in list(islice(self._changed_at, len(self._changed_at) // 2)):
                self._floor = max(self._floor, self._changed_at.pop(old))

    def touch(self, key: str) -> None:
        """Number a change of ``key`` that does not hide it: reads of it in flight from another
        tier keep no copy (see ``TieredStore.invalidate_reads``)."""
        self._stamp(key)

    def begin(self, key: str) -> None:
        """A remove of ``key`` starts: number it and hide the key until :meth:`end`."""
        self._stamp(key)
        self.hold(key)

    def hold(self, key: str) -> None:
        """One more deletion of ``key``'s SSD copy is owed (an offload in flight will land one)."""
        self._hidden[key] = self._hidden.get(key, 0) + 1

    def end(self, key: str, deleted: bool) -> bool:
        """One owed deletion is done (``deleted``: the SSD copy is gone or was never there).
        Returns True when the key is visible on SSD again."""
        self._stamp(key)
        left = self._hidden.get(key, 0) - 1
        if left > 0:
            self._hidden[key] = left
        else:
            self._hidden.pop(key, None)
        if deleted:
            self._stuck.discard(key)
        else:
            self._stuck.add(key)
        return not self.hidden(key)

    def hidden(self, key: str) -> bool:
        return key in self._hidden or key in self._stuck

    def deleting(self, key: str) -> bool:
        """A deletion of ``key``'s SSD copy is under way (it ends with :meth:`end`)."""
        return key in self._hidden

    def stuck(self, key: str) -> bool:
        """Hidden only because an earlier deletion failed (no deletion of it under way now)."""
        return key in self._stuck and key not in self._hidden


class Ticket:
    """The rule "ask a lower tier outside the lock, then re-check under the lock that no remove or
    eviction intervened", in one place. Taken under the store lock before a lookup, read or write
    outside it; asked under the lock again after, per key. Not thread-safe (the store's lock
    guards it, as it guards the trackers it reads)."""

    __slots__ = ("_removals", "_removed_at", "_evictions", "_evicted_at")

    def __init__(self, removals: RemovalTracker, evictions: EvictionClock) -> None:
        self._removals = removals
        self._removed_at = removals.generation()
        self._evictions = evictions
        self._evicted_at = evictions.generation()

    def removed(self, key: str) -> bool:
        """What was learned of ``key`` outside the lock is not to be trusted: it is being removed
        now (hidden), or a removal of it began, or an owed deletion of its copy below ended, since
        the ticket was taken. A copy read or found meanwhile may be the removed bytes."""
        return self._removals.hidden(key) or self._removals.changed_since(key, self._removed_at)

    def changed(self, key: str) -> bool:
        """``key`` is visible now but its visibility changed since the ticket was taken (a removal
        began and ended): an answer about it is worth asking again, not taking."""
        return not self._removals.hidden(key) and self._removals.changed_since(key, self._removed_at)

    def evicted(self, key: str) -> bool:
        """A tier below reported an eviction of ``key`` since the ticket was taken: a write of it
        that landed meanwhile may be gone (see :class:`EvictionClock`)."""
        return self._evictions.changed_since(key, self._evicted_at)


class LossLedger:
    """Objects dropped from DRAM before they reached SSD, each with why (bounded).

    Each loss carries the put number of the object lost (the store numbers its puts), so a flush
    reports only losses of objects put before it began. Past the bound the oldest losses are
    forgotten; they are counted, and the next flush whose start covers them reports that count
    once (rather than every flush forever after)."""

    def __init__(self, max_keys: int = _REMEMBERED_MAX) -> None:
        self._lost: dict[str, tuple[int, str]] = {}  # key -> (put number, why), oldest loss first
        self._max = max_keys
        self._forgotten = 0  # losses dropped past the bound, not yet reported by a flush
        self._forgotten_min = 0  # the lowest and highest put numbers among them
        self._forgotten_max = 0

    def record(self, key: str, put_seq: int, why: str) -> None:
        self._lost.pop(key, None)
        self._lost[key] = (put_seq, why)
        if len(self._lost) > self._max:
            old = next(iter(self._lost))
            seq, _why = self._lost.pop(old)
            self._forgotten_min = seq if not self._forgotten else min(self._forgotten_min, seq)
            self._forgotten_max = max(self._forgotten_max, seq)
            self._forgotten += 1

    def clear(self, key: str) -> None:
        """``key`` was stored again or removed: its loss no longer matters."""
        self._lost.pop(key, None)

    def items(self, put_seq_max: int) -> list[tuple[str, str]]:
        """Losses of objects put at or before put number ``put_seq_max``, with why."""
        return [(k, why) for k, (seq, why) in self._lost.items() if seq <= put_seq_max]

    def take_forgotten(self, put_seq_max: int) -> int:
        """How many forgotten losses may concern objects put at or before ``put_seq_max``; once
        every one of them does, they are reported (by this caller) and not again."""
        if not self._forgotten or self._forgotten_min > put_seq_max:
            return 0
        n = self._forgotten
        if self._forgotten_max <= put_seq_max:
            self._forgotten = self._forgotten_max = 0
        return n


class EvictionClock:
    """Numbers the evictions that lower tiers report, per key, so that work which wrote a key below
    outside the lock can ask at commit time whether that tier evicted the key meanwhile.

    The race it closes: an offload's ``put`` of k returns OK, then another write evicts k below and
    its report is handled before the offload marks k persisted. The offload reads
    :meth:`generation` when it forms its batch and marks k persisted only when
    ``not changed_since(k, generation)``; otherwise k stays dirty and is written again. Every race
    ends dirty: a redundant write, never a dropped last copy. Bounded like :class:`RemovalTracker`
    (conservative for keys it forgot).
    """

    def __init__(self, remembered_max: int = _REMEMBERED_MAX) -> None:
        self._seq = 0
        self._changed_at: dict[str, int] = {}  # key -> number of its latest eviction, oldest first
        self._floor = 0
        self._max = remembered_max

    def generation(self) -> int:
        return self._seq

    def changed_since(self, key: str, generation: int) -> bool:
        """Whether a tier below reported an eviction of ``key`` after ``generation`` was read."""
        return self._changed_at.get(key, self._floor) > generation

    def stamp(self, key: str) -> None:
        """A tier below evicted ``key``."""
        self._seq += 1
        self._changed_at.pop(key, None)
        self._changed_at[key] = self._seq
        if len(self._changed_at) > self._max:
            for old in list(islice(self._changed_at, len(self._changed_at) // 2)):
                self._floor = max(self._floor, self._changed_at.pop(old))


class KnownBelow:
    """Keys believed to have a copy in the backing tier, for admission's "is the parent stored?"
    without asking that tier under the lock: those DRAM dropped while they were persisted, those
    the backing tier held when the store opened (:meth:`seed`), those a put found there (EXISTS)
    and those a read was served from there. A bounded FIFO: keys evicted below or removed leave it,
    the oldest are forgotten past
    ``max_keys`` (a forgotten parent counts as not stored: its child stays declined, as admission
    wanted for an unknown prefix)."""

    def __init__(self, max_keys: int = _REMEMBERED_MAX) -> None:
        self._keys: dict[str, None] = {}
        self._max = max_keys

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        if len(self._keys) > self._max:
            del self._keys[next(iter(self._keys))]

    def seed(self, keys: Iterable[str]) -> None:
        """Add ``keys`` (a tier's snapshot, oldest first); only the newest ``max_keys`` are kept,
        without holding more than that many at once."""
        for key in collections.deque(keys, maxlen=self._max):
            self.add(key)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
