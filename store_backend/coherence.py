"""Bookkeeping that keeps ``remove`` airtight and ``flush`` honest while bytes move between tiers.

Owned by :class:`store_backend.store.TieredStore` and called only under its lock: not thread-safe
itself, and never does I/O.

Removal. The store deletes an object's SSD copy outside its lock, and background work (an offload
write, a promotion read) may have begun before the remove did. So:

- a key is *hidden* on SSD from the moment ``remove`` takes it until its SSD copy is deleted, and
  for as long as an offload write that began before the remove may still land a copy (the offload
  deletes that copy when it finishes). Reads, lookups, promotions and new SSD writes treat a hidden
  key as absent on SSD; a key whose deletion failed stays hidden until a later one succeeds;
- every removal takes a number from one increasing sequence, so work that looked a key up on SSD
  outside the lock can ask at commit time whether a remove of that key came in between.

Loss. Objects dropped from DRAM before they reached SSD are remembered (bounded) with the reason,
so that ``flush`` can say which objects put before it are not persisted.
"""

from __future__ import annotations

from itertools import islice

_REMEMBERED_MAX = 1 << 16


class RemovalTracker:
    """Hidden keys and removal numbers (see the module docstring)."""

    def __init__(self, remembered_max: int = _REMEMBERED_MAX) -> None:
        self._hidden: dict[str, int] = {}  # key -> deletions of its SSD copy still owed
        self._stuck: set[str] = set()  # keys whose SSD copy could not be deleted
        self._seq = 0
        self._removed_at: dict[str, int] = {}  # key -> number of its latest removal, oldest first
        self._floor = 0  # a key no longer remembered counts as removed at this number
        self._max = remembered_max

    def generation(self) -> int:
        """The number of the latest removal; compare with :meth:`removed_since` later."""
        return self._seq

    def removed_since(self, key: str, generation: int) -> bool:
        """Whether ``key`` may have been removed after ``generation`` was read (conservative for
        keys forgotten to keep the table bounded)."""
        return self._removed_at.get(key, self._floor) > generation

    def begin(self, key: str) -> None:
        """A remove of ``key`` starts: number it and hide the key until :meth:`end`."""
        self._seq += 1
        self._removed_at.pop(key, None)  # re-inserted last, so the dict stays oldest-first
        self._removed_at[key] = self._seq
        if len(self._removed_at) > self._max:
            for old in list(islice(self._removed_at, len(self._removed_at) // 2)):
                self._floor = max(self._floor, self._removed_at.pop(old))
        self.hold(key)

    def hold(self, key: str) -> None:
        """One more deletion of ``key``'s SSD copy is owed (an offload in flight will land one)."""
        self._hidden[key] = self._hidden.get(key, 0) + 1

    def end(self, key: str, deleted: bool) -> bool:
        """One owed deletion is done (``deleted``: the SSD copy is gone or was never there).
        Returns True when the key is visible on SSD again."""
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


class LossLedger:
    """Objects dropped from DRAM before they reached SSD, each with why (bounded)."""

    def __init__(self, max_keys: int = _REMEMBERED_MAX) -> None:
        self._lost: dict[str, str] = {}
        self._max = max_keys
        self.untracked = 0  # losses past the bound, counted only

    def record(self, key: str, why: str) -> None:
        if key in self._lost or len(self._lost) < self._max:
            self._lost[key] = why
        else:
            self.untracked += 1

    def clear(self, key: str) -> None:
        """``key`` was stored again or removed: its loss no longer matters."""
        self._lost.pop(key, None)

    def items(self) -> list[tuple[str, str]]:
        return list(self._lost.items())
