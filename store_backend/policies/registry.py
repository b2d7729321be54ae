"""Policy names -> factories, one constructor shape (no arguments)."""

from __future__ import annotations

from collections.abc import Callable

from store_backend.policies.base import EvictionPolicy
from store_backend.policies.lru import FifoPolicy, LruPolicy

_FACTORIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "fifo": FifoPolicy,
}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    _FACTORIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance; raises ValueError naming the known policies for an unknown name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {policy_names()}") from None
    return factory()
