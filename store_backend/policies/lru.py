"""Least-recently-used and first-in-first-out eviction: the classic baselines.

Pure decision code (see ``base.py``); the owning tier calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LruPolicy:
    """Evicts the object whose last insert or access is oldest."""

    name = "lru"
    touch_on_access = True

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first

    def on_insert(self, key: str, size: int, parent: str | None = None) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: str) -> None:
        if self.touch_on_access and key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self, need_bytes: int, can_evict: Callable[[str], bool]) -> list[str]:
        out: list[str] = []
        freed = 0
        for key, size in self._order.items():
            if freed >= need_bytes:
                break
            if can_evict(key):
                out.append(key)
                freed += size
        return out

    def admit(self, key: str, size: int) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._order)


class FifoPolicy(LruPolicy):
    """Evicts the object inserted first; reads do not change the order."""

    name = "fifo"
    touch_on_access = False
