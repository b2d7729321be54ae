"""Policy names -> factories, one constructor shape (no arguments).

Every built-in policy is registered here, so ``make_policy`` (and a config naming a policy) finds it
whichever module was imported first. ``register_policy`` adds one from outside the package.
"""

from __future__ import annotations

from collections.abc import Callable

from store_backend.policies.base import EvictionPolicy
from store_backend.policies.lru import FifoPolicy, LruPolicy
from store_backend.policies.prefix_reuse import PrefixLruPolicy, PrefixReusePolicy

_FACTORIES: dict[str, Callable[[], EvictionPolicy]] = {
    LruPolicy.name: LruPolicy,
    FifoPolicy.name: FifoPolicy,
    PrefixReusePolicy.name: PrefixReusePolicy,
    PrefixLruPolicy.name: PrefixLruPolicy,
}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make ``name`` a known policy (a config may name it from now on); replaces one of that name."""
    _FACTORIES[name] = factory


def unregister_policy(name: str) -> None:
    """Forget a policy added by :func:`register_policy` (a no-op for an unknown name)."""
    _FACTORIES.pop(name, None)


def policy_names() -> list[str]:
    return sorted(_FACTORIES)


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance; raises ValueError naming the known policies for an unknown name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {policy_names()}") from None
    return factory()
