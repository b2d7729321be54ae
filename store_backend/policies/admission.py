"""SSD admission: which objects leaving (or copied out of) DRAM are worth a write to the SSD tier.

An SSD write that is never read costs device bandwidth and endurance for nothing. The decision uses
the same facts as the prefix-aware eviction policy (``prefix_reuse.py``): whether the object's
prefix is still stored anywhere (a chunk whose parent is gone can never be part of a prefix hit),
and how often the object has been requested (its use count, as the DRAM policy knows it from hits
and its ghost list: ``PrefixReusePolicy.uses_of``).

Pure decision code: the store asks, per object and under its lock, when the object is offloaded
and again, for one it declined, when DRAM is about to evict it. Policies are stateless, so one
instance may be shared.

    admission = make_admission(cfg.ssd.admission_policy)
    if admission.admit(key, size, uses=policy_uses(policy, key), parent_stored=...):
        ... write it to SSD ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class AdmissionPolicy(Protocol):
    name: str

    def admit(self, key: str, size: int, *, uses: int, parent_stored: bool) -> bool:
        """Whether ``key`` should be written to the SSD tier.

        ``uses``: requests seen for the object (1 = stored once, never hit; 0 = unknown).
        ``parent_stored``: the object has no parent, or its parent is in DRAM or on SSD (or is being
        written there). Never raises, never blocks.
        """


class AdmitAll:
    """Every offloaded object is written (the store's behaviour without admission control)."""

    name = "all"

    def admit(self, key: str, size: int, *, uses: int, parent_stored: bool) -> bool:
        return True


class AdmitPrefix:
    """Writes every object whose prefix is still stored; skips orphans, which cannot be hit.

    A lookup counts leading hits, so an orphan cannot be hit while its parent is stored nowhere. The
    store asks again when DRAM is about to evict a declined object, so one whose parent was put
    again meanwhile is written then. A hit is lost only when the parent comes back after the orphan
    has left DRAM, put by a request that ends at the parent, and a later request wants both.
    """

    name = "prefix"

    def admit(self, key: str, size: int, *, uses: int, parent_stored: bool) -> bool:
        return parent_stored


class AdmitReused:
    """Writes only objects requested at least ``min_uses`` times whose prefix is still stored.

    With write-back offload (``offload.policy: watermark``) the decision is taken when an object
    leaves DRAM. With eager offload it is taken at put time, when the count is 1, so the object is
    declined; the store asks again when DRAM is about to evict it, and writes it then if it has been
    requested twice by that time.
    """

    name = "reused"

    def __init__(self, min_uses: int = 2) -> None:
        if min_uses < 1:
            raise ValueError(f"min_uses must be >= 1, got {min_uses}")
        self.min_uses = min_uses

    def admit(self, key: str, size: int, *, uses: int, parent_stored: bool) -> bool:
        return parent_stored and uses >= self.min_uses


_FACTORIES: dict[str, Callable[[], AdmissionPolicy]] = {
    AdmitAll.name: AdmitAll,
    AdmitPrefix.name: AdmitPrefix,
    AdmitReused.name: AdmitReused,
}


def admission_names() -> list[str]:
    return sorted(_FACTORIES)


def make_admission(name: str) -> AdmissionPolicy:
    """An admission policy by name; raises ValueError naming the known ones for an unknown name."""
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; known: {admission_names()}") from None


def policy_uses(policy: object, key: str) -> int:
    """Use count of ``key`` from an eviction policy that tracks it (``uses_of``), else 1."""
    uses_of = getattr(policy, "uses_of", None)
    return int(uses_of(key)) if uses_of is not None else 1
