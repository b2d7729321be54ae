"""Which prefill instance may hand its KV to which decode instance: their KV layouts must match.

Each engine with the vLLM connector publishes its layout in its ``/metrics`` (the info gauge
:data:`~mooncake_connector.kv_layout.LAYOUT_INFO`: TP and PP size, KV heads per shard,
``chunk_tokens``, hash scheme and a digest of the key fingerprint). A decode instance whose layout
differs from a prefill instance's cannot load a single chunk the prefill instance stored: the
keys differ (the KV is not re-sharded on load). The router reads the layouts at its health checks
(``server.py``), refuses to start when two instances it could pair differ, and never pairs an
instance found to differ later.

Pure (no clock, no I/O). An instance whose layout is unknown (not read yet, or its ``/metrics``
has no such gauge: an engine without this connector, or an older one) is paired with any; the
decode engine's own check of the transfer parameters' ``remote_fingerprint`` still keeps it from
waiting for chunks it cannot load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_connector.kv_layout import KVLayout

PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")


class IncompatibleLayouts(Exception):
    """The router refuses to start: a prefill instance and a decode instance it could pair have
    different KV layouts. The message names every such pair and what differs."""


@dataclass(frozen=True)
class Mismatch:
    """A prefill instance and a decode instance whose layouts differ; ``differs``: what, one
    phrase each, the prefill instance's value first (:meth:`KVLayout.differences`)."""

    prefill: str
    decode: str
    prefill_layout: KVLayout
    decode_layout: KVLayout
    differs: tuple[str, ...]

    @property
    def tp_differs(self) -> bool:
        return self.prefill_layout.tp_size != self.decode_layout.tp_size

    def describe(self) -> str:
        """One sentence naming both instances, their TP sizes and what differs."""
        return (f"prefill instance {self.prefill!r} (TP {self.prefill_layout.tp_size}) and decode instance "
                f"{self.decode!r} (TP {self.decode_layout.tp_size}) have different KV layouts: "
                f"{', '.join(self.differs)}")

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "prefill_tp_size": self.prefill_layout.tp_size,
                "decode_tp_size": self.decode_layout.tp_size, "differs": list(self.differs)}


def mismatches(layouts: Mapping[str, KVLayout | None], roles: Mapping[str, str]) -> list[Mismatch]:
    """Every pair of two instances, one that can prefill (``roles``: prefill or both) and one that
    can decode (decode or both), whose layouts are both known and differ; by prefill, then decode
    name. An instance of role both is never paired with itself."""
    out: list[Mismatch] = []
    for p in sorted(n for n, r in roles.items() if r in PREFILL_ROLES):
        for d in sorted(n for n, r in roles.items() if r in DECODE_ROLES):
            lp, ld = layouts.get(p), layouts.get(d)
            if p == d or lp is None or ld is None:
                continue
            differs = lp.differences(ld)
            if differs:
                out.append(Mismatch(p, d, lp, ld, tuple(differs)))
    return out


def why_not_paired(found: Iterable[Mismatch]) -> str:
    """What follows from ``found`` for the operator (the end of the router's errors)."""
    if any(m.tp_differs for m in found):
        return ("Prefill/decode across different tensor-parallel sizes is not supported (the KV is not "
                "re-sharded on load): the decode instance could not load what the prefill instance stores. "
                "Run prefill and decode with the same TP size, or give each layout a router of its own.")
    return ("The decode instance could not load what the prefill instance stores. Run prefill and decode with "
            "the same model, weights, KV dtype, chunk_tokens and hash scheme.")


def refusal(found: Sequence[Mismatch]) -> str:
    """The router's error when it refuses to start over ``found`` (not empty): every pair, then
    what follows."""
    return f"{'; '.join(m.describe() for m in found)}. {why_not_paired(found)}"


def unpairable(found: Iterable[Mismatch], decode: str) -> set[str]:
    """The prefill instances ``decode`` must never be paired with."""
    return {m.prefill for m in found if m.decode == decode}
