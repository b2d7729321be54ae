"""Pure decisions of the tiered store: data in, plan out (no locks, no I/O).

Called by the store under its lock; everything here is a function of its arguments. The facts
passed in are the store's in-memory bookkeeping only: nothing here (nor the store, while it holds
its lock) asks a lower tier anything.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class VictimFacts:
    """What the store knows about one DRAM entry an eviction or a demotion considers."""

    key: str
    size: int
    evictable: bool  # READY, not leased, not pinned (or its pin expired)
    persisted: bool  # a copy in the backing tier (kept honest by that tier's eviction events)
    declined: bool  # the backing tier's admission policy refused it before
    readmit: bool  # admission accepts it now (asked only for declined entries), from in-memory facts
    offload_failures: int  # failed or refused writes to the backing tier so far
    offload_queued: bool  # waiting in the offload queue now


class Verdict(enum.Enum):
    EVICT = 1  # drop it now
    KEEP = 2  # not now, and not for want of a write (leased, pinned, being written; or given up and spared)
    WRITE_BACK = 3  # not now; queue its write to the backing tier (then it may go)
    WAIT = 4  # not now; its write is queued or in flight (or a demotion pass takes it): room comes when it lands


class EvictPass(enum.Enum):
    """Which DRAM entries one eviction pass may take (see :func:`evict_pass_order`)."""

    CLEAN = 1  # entries with a copy below, or that admission keeps off it: dropping them loses nothing
    GIVEN_UP = 2  # also dirty entries whose writes used up their attempts (the backing tier refuses them)
    ANY = 3  # no backing tier: nothing is ever persisted, so any evictable entry goes


def victim_verdict(f: VictimFacts, *, evict_pass: EvictPass, max_attempts: int, write_all: bool = False) -> Verdict:
    """Whether DRAM eviction may take ``f``'s entry in this pass.

    ``EvictPass.ANY`` (no backing tier): anything evictable goes. Otherwise a clean entry goes (a
    persisted one, or a declined one that admission still declines; a declined one that admission
    now accepts is written back first), and a dirty entry never does while its write is still
    owed: it is written back when no write of it is queued and either an earlier write failed
    (fewer than ``max_attempts`` times) or ``write_all`` (the offload workers run, so every dirty
    entry is owed a write: in eager mode one put before ``start()`` or refused by a full queue, in
    watermark mode one that eviction needs before a demotion pass came to it); else it waits for
    the write that is coming (``WAIT``: a put may wait for that room). Only the ``GIVEN_UP`` pass
    takes a dirty entry, and only one whose writes failed ``max_attempts`` times (the disk is
    broken or full: the store counts it as ``dropped_unpersisted``).
    """
    if not f.evictable:
        return Verdict.KEEP
    if evict_pass is EvictPass.ANY:
        return Verdict.EVICT
    if f.declined:
        return Verdict.WRITE_BACK if f.readmit else Verdict.EVICT
    if f.persisted:
        return Verdict.EVICT
    if f.offload_failures >= max_attempts:
        return Verdict.EVICT if evict_pass is EvictPass.GIVEN_UP else Verdict.KEEP
    if not f.offload_queued and (f.offload_failures > 0 or write_all):
        return Verdict.WRITE_BACK
    return Verdict.WAIT


def demotion_split(victims: Sequence[VictimFacts]) -> tuple[list[str], list[str]]:
    """A watermark demotion's victims as (drop now, write then drop): a clean entry (persisted, or
    declined and still declined by admission) is just dropped; every other one is written to the
    backing tier first (a declined one that admission now accepts included)."""
    drop: list[str] = []
    write: list[str] = []
    for f in victims:
        if f.persisted or (f.declined and not f.readmit):
            drop.append(f.key)
        else:
            write.append(f.key)
    return drop, write


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


def evict_pass_order(has_backing: bool) -> tuple[EvictPass, ...]:
    """The passes of one DRAM eviction, in order: clean entries first, then entries given up on.

    Without a backing tier there is nothing to persist to, so any entry goes in one pass. With
    one, no pass takes a dirty entry whose write is still owed: when only such entries stand in
    the way, the put waits for the offload (``offload.put_wait_s``) or is refused (NO_SPACE),
    so the newest put gives way, never an older acknowledged object.
    """
    return (EvictPass.ANY,) if not has_backing else (EvictPass.CLEAN, EvictPass.GIVEN_UP)


def room_owed(met_pending_write: bool, writes_in_flight: bool, offload_running: bool) -> bool:
    """Whether a put that found no room may wait for the offload to make some: a write in flight
    ends by itself, and a dirty entry that only waits for its write (:attr:`Verdict.WAIT`, or
    one just queued, :attr:`Verdict.WRITE_BACK`) becomes clean once the running offload writes
    it. Otherwise (everything leased, pinned or given up, or nothing writes) waiting is useless."""
    return writes_in_flight or (met_pending_write and offload_running)


def replica_targets(key_sizes: Sequence[tuple[str, int]], nodes: Sequence[Any], self_id: str,
                    replicas: int) -> dict[str, list[str]]:
    """Where the extra copies of newly stored objects go: ``{node_id: [keys]}``.

    ``key_sizes`` are (key, size in bytes) in the order they were stored; ``nodes`` the
    directory's :class:`~store_backend.pool.directory.NodeInfo` list (``node_id``, ``alive``,
    ``free_bytes``); ``replicas`` counts the local copy, so each key gets ``replicas - 1`` peers.
    A key goes to the live peers (never ``self_id``, never a dead node) with the most free
    bytes left after what this plan already placed on them (ties: the smaller node id), each at
    most once, and only where it still fits; a key with too few such peers gets fewer copies.
    Deterministic: the same facts give the same plan."""
    extra = replicas - 1
    if extra <= 0 or not key_sizes:
        return {}
    free = {n.node_id: int(n.free_bytes) for n in nodes if n.alive and n.node_id != self_id}
    plan: dict[str, list[str]] = {}
    for key, size in key_sizes:
        ranked = sorted((node for node, room in free.items() if room >= size), key=lambda node: (-free[node], node))
        for node in ranked[:extra]:
            free[node] -= size
            plan.setdefault(node, []).append(key)
    return plan
