"""Pure decisions of the tiered store: data in, plan out (no locks, no I/O).

Called by the store under its lock; everything here is a function of its arguments.
"""

from __future__ import annotations


def demotion_bytes(used_bytes: int, capacity_bytes: int, high: float, low: float) -> int:
    """Watermark offload: bytes to move down once use passes ``high``, to bring it to ``low``."""
    if used_bytes <= high * capacity_bytes:
        return 0
    return max(0, used_bytes - int(low * capacity_bytes))


def should_promote(ssd_hits: int, admission_hits: int, enabled: bool, dram_uses: int = 1) -> bool:
    """Promote an SSD-resident object once it has been hit ``admission_hits`` times, or at its first
    SSD hit when the DRAM eviction policy remembers it as requested more than once before it moved
    down (``dram_uses`` >= 2: a reused chunk, the kind ``prefix_reuse`` keeps longer)."""
    return enabled and (ssd_hits >= admission_hits or (ssd_hits >= 1 and dram_uses >= 2))


def evict_pass_order(has_ssd: bool) -> tuple[bool, ...]:
    """Which DRAM entries eviction may take, pass by pass: persisted ones first, then any.

    Without an SSD tier there is nothing to persist to, so any entry goes in one pass. The second
    pass drops objects that never reached SSD; the store counts those as ``dropped_unpersisted``.
    """
    return (False,) if not has_ssd else (True, False)
