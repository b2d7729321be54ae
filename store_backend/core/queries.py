"""Queries: presence, leading hits, sizes, tiers and keys, each tier asked outside the store lock and
re-checked after.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from store_backend.core.common import _LOOKUP_TRIES, _WAIT_SLICE_S
from store_backend.dram import DramSnapshot, EntryState
from store_backend.tiers.base import Tier
from store_backend.types import check_batch, check_key, check_wait_s

logger = logging.getLogger(__name__)


class StoreQueries:
    """Queries of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    def _ask_tier(self, ask: Any, keys: Sequence[str], absent: Any) -> list[Any]:
        """Ask one tier's index about ``keys`` outside the store lock (``ask(keys)`` answers per
        key); a key being removed answers ``absent``. An answer for a key whose visibility changed
        while it was asked (an old copy that an offload landed after a remove, seen just before it
        was deleted) is asked again, and after a few tries taken as ``absent``."""
        out = [absent] * len(keys)
        todo = list(range(len(keys)))
        for attempt in range(_LOOKUP_TRIES):
            if not todo:
                break
            with self._lock:
                ticket = self._ticket()
            answers = ask([keys[i] for i in todo])
            again: list[int] = []
            with self._lock:
                for i, a in zip(todo, answers):
                    out[i] = absent if ticket.removed(keys[i]) else a
                    if ticket.changed(keys[i]):
                        again.append(i)
            todo = again
        return out

    def _ask_below(self, method: str, keys: Sequence[str], absent: Any,
                   tiers: Sequence[Tier] | None = None) -> list[tuple[Any, Tier | None]]:
        """(answer, tier that gave it) per key: ``method`` asked of each tier in order (all of
        ``_below`` unless ``tiers``), each for the keys the ones before it answered ``absent``
        for (see :meth:`_ask_tier`); (``absent``, None) when no tier had the key."""
        out: list[tuple[Any, Tier | None]] = [(absent, None)] * len(keys)
        todo = list(range(len(keys)))
        for tier in self._below if tiers is None else tiers:
            if not todo:
                break
            answers = self._ask_tier(getattr(tier, method), [keys[i] for i in todo], absent)
            for i, a in zip(todo, answers):
                if a != absent:
                    out[i] = (a, tier)
            todo = [i for i in todo if out[i][1] is None]
        return out

    def _on_below(self, keys: Sequence[str], tiers: Sequence[Tier] | None = None) -> list[bool]:
        """Presence in any tier below (or in ``tiers``), outside the store lock; a key being
        removed is absent."""
        return [t is not None for _a, t in self._ask_below("contains", keys, False, tiers)] if keys else []

    def _on_backing(self, keys: Sequence[str]) -> list[bool]:
        """Presence in the backing tier (the offload target), outside the store lock."""
        return self._on_below(keys, [self._backing]) if self._backing is not None else [False] * len(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present in any tier (an object still being written is not)."""
        check_batch(keys)
        with self._call():
            return self._present(keys, count_reserved=False)[0]

    def _present(self, keys: Sequence[str], *, count_reserved: bool,
                 local_only: bool = False) -> tuple[list[bool], int]:
        """(call held, lock not held) Presence per key in any tier (``local_only``: this node's),
        and the store's commit count read before DRAM was looked at. ``count_reserved``: an entry
        being written counts."""
        with self._lock:
            if count_reserved:
                self._expire_slots()  # an expired reservation is a save that will not land
            commits = self._commits
            entries = self._dram.entries
            out = [check_key(k) is None and (e := entries.get(k)) is not None
                   and (count_reserved or e.state is EntryState.READY) for k in keys]
        rest = [i for i, hit in enumerate(out) if not hit and check_key(keys[i]) is None]
        if rest and self._below:
            tiers = self._local_tiers() if local_only else None
            for i, hit in zip(rest, self._on_below([keys[i] for i in rest], tiers)):
                out[i] = hit
        return out, commits

    @staticmethod
    def _leading(hits: Sequence[bool]) -> int:
        n = 0
        for hit in hits:
            if not hit:
                break
            n += 1
        return n

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0,
               local_only: bool = False) -> int:
        """Number of leading keys present (for prefix-chained keys: the reusable prefix length).

        ``count_reserved``: a key reserved and not yet committed (a save in flight) counts as
        present. ``wait_s`` > 0: when not all keys are present, wait (blocking, up to ``wait_s``)
        for commits until they are, then answer what is present at that moment (fewer at the
        deadline). ``wait_s`` outside [0, ``MAX_PIN_TTL_S``]: ValueError naming it.
        ``local_only``: this node's tiers only (not what the pool's other nodes hold)."""
        check_batch(keys)
        check_wait_s("wait_s", wait_s)
        until = time.monotonic() + wait_s
        while True:
            with self._call():
                hits, commits = self._present(keys, count_reserved=count_reserved, local_only=local_only)
            n = self._leading(hits)
            if n == len(keys) or wait_s <= 0:
                return n
            with self._lock:
                self._check_open()
                left = until - time.monotonic()
                if left <= 0:
                    return n
                if self._commits == commits:  # nothing committed since DRAM was looked at
                    # Waits are woken by commits; the slice is a backstop for copies that land
                    # below without one (another process's writes to a shared directory).
                    self._slot_changed.wait(min(left, _WAIT_SLICE_S))
                    self._check_open()

    def exists_all(self, key_lists: Sequence[Sequence[str]], *, count_reserved: bool = False) -> int:
        """The shortest leading run of present keys over ``key_lists`` (one list per TP rank or
        shard: what every one of them can load), in one call; 0 for no lists. ``count_reserved``
        as in :meth:`exists`. Thread-safe."""
        if isinstance(key_lists, (str, bytes)):
            raise TypeError("key_lists must be a sequence of key lists, not a single str")
        for keys in key_lists:
            check_batch(keys)
        if not key_lists:
            return 0
        flat = [k for keys in key_lists for k in keys]
        with self._call():
            hits, _commits = self._present(flat, count_reserved=count_reserved)
        n, at = None, 0
        for keys in key_lists:
            run = self._leading(hits[at:at + len(keys)])
            n = run if n is None else min(n, run)
            at += len(keys)
        return n or 0

    def tier_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[str | None]:
        """"dram", a lower tier's name ("ssd", "pool") or None for each key (the fastest tier
        holding it). ``local_only``: this node's tiers only (those answering from memory; the
        pool's lookup, a network round trip, is not made)."""
        check_batch(keys)
        with self._call():
            with self._lock:
                out: list[str | None] = [
                    "dram" if check_key(k) is None and self._dram.ready(k) is not None else None for k in keys
                ]
            rest = [i for i, t in enumerate(out) if t is None and check_key(keys[i]) is None]
            if rest and self._below:
                tiers = self._local_tiers() if local_only else None
                for i, (_hit, tier) in zip(rest, self._ask_below("contains", [keys[i] for i in rest], False, tiers)):
                    out[i] = None if tier is None else tier.name
            return out

    def _local_tiers(self) -> list[Tier]:
        """The tiers below DRAM that are this node's own (they answer from memory: not a pool)."""
        return [t for t in self._below if t.traits.local_index]

    def keys(self, prefix: str = "") -> list[str]:
        """Every stored key starting with ``prefix`` (in any tier of this node, each once; not what
        other nodes of a pool hold). A snapshot: O(objects)."""
        out: list[str] = []
        seen: set[str] = set()
        for keys in self.residency(prefix).values():
            out.extend(k for k in keys if k not in seen)
            seen.update(keys)
        return out

    def residency(self, prefix: str = "") -> dict[str, list[str]]:
        """Every stored key starting with ``prefix``, per tier of this node: "dram", then each
        local tier below in order ("ssd"); a key with copies in two tiers is under both (not what
        other nodes of a pool hold). A snapshot: O(objects); tiers below are listed outside the
        lock, and a key a remove ended meanwhile is asked again."""
        with self._call():
            with self._lock:
                out = {"dram": [k for k, e in self._dram.entries.items()
                                if e.state is EntryState.READY and k.startswith(prefix)]}
            for tier in self._local_tiers():
                with self._lock:
                    ticket = self._ticket()
                below = [k for k in tier.keys() if k.startswith(prefix)]
                with self._lock:
                    changed = [k for k in below if ticket.changed(k)]
                    found = [k for k in below if not ticket.removed(k)]
                if changed:  # seen while a removal of them ended: asked again
                    found.extend(k for k, hit in zip(changed, self._on_below(changed, [tier])) if hit)
                out[tier.name] = found
            return out

    def dram_snapshot(self, keys: Sequence[str] | None = None) -> DramSnapshot:
        """A copy of the DRAM index at one moment: the arena's used bytes and each entry's
        bookkeeping (:class:`~store_backend.dram.EntryFacts`: persisted, declined, leases, pins
        ...), for ``keys`` (those not in DRAM are left out) or for every entry, writes still copying
        in included. Read-only and thread-safe: one brief hold of the store lock, O(entries asked);
        no tier below is asked. For tools and tests that observe residency; engines use
        :meth:`tier_of` and :meth:`contains`."""
        with self._call():
            with self._lock:
                entries = self._dram.entries
                picked = entries.values() if keys is None else [entries[k] for k in keys if k in entries]
                return DramSnapshot(self._dram.used_bytes, self._dram.capacity_bytes,
                                    {e.key: self._dram.facts(e) for e in picked})

    def size_of(self, keys: Sequence[str], *, local_only: bool = False) -> list[int | None]:
        """Each object's size in bytes, or None when it is stored nowhere (``local_only``: on no
        tier of this node)."""
        check_batch(keys)
        with self._call():
            with self._lock:
                out: list[int | None] = []
                for k in keys:
                    e = self._dram.ready(k) if check_key(k) is None else None
                    out.append(None if e is None else e.size)
            rest = [i for i, s in enumerate(out) if s is None and check_key(keys[i]) is None]
            if rest and self._below:
                tiers = self._local_tiers() if local_only else None
                for i, (size, _tier) in zip(rest, self._ask_below("size_of", [keys[i] for i in rest], None, tiers)):
                    out[i] = size
            return out
