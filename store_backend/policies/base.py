"""The eviction/admission seam: pure decision code, no I/O, no threads.

A policy is told what happens to the objects of one tier (insert, access, remove) and answers with
plans: which keys to evict to free a number of bytes, whether to admit a new object. The tier owns
the bytes and carries the plan out; a policy never touches them. Policies are not thread-safe: the
owning tier calls them under its own lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: str, size: int, parent: str | None = None) -> None:
        """A new object is resident. ``parent`` is the key of the prefix chunk before it, if known."""

    def on_access(self, key: str) -> None:
        """A resident object was read (a hit)."""

    def on_remove(self, key: str) -> None:
        """An object left the tier (evicted, removed, moved down). Unknown keys are ignored."""

    def victims(self, need_bytes: int, can_evict: Callable[[str], bool]) -> list[str]:
        """Keys to evict, in order, whose sizes add up to at least ``need_bytes``.

        Only keys for which ``can_evict(key)`` is true may be returned. Returns fewer (possibly no)
        keys when not enough are evictable. Does not change the policy's state: the tier calls
        ``on_remove`` for each key it actually evicts.
        """

    def admit(self, key: str, size: int) -> bool:
        """Whether a new object should enter this tier at all (admission control)."""

    def __len__(self) -> int: ...
