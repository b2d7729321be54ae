"""A fast in-memory stand-in for the DRAM tier, to try eviction policies on whole traces quickly.

It drives an :class:`~store_backend.policies.base.EvictionPolicy` with the same calls, in the same
order, as ``TieredStore`` does during a replay (lookup; ``on_access`` for the hit blocks; for each
missing block ``victims`` until it fits and ``on_remove`` per victim; then ``on_insert`` of the
new blocks with their parents, in order, once the batch is in; a put of a block that is still
resident answers EXISTS and tells the policy nothing). It
counts capacity in blocks and has no bytes, threads or SSD tier, so it runs about ten times faster
than the real store. The replay's reported numbers come from the real store; this is for
exploration and for tests of policies in isolation.

Single-threaded; called on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable

from store_backend.policies.base import EvictionPolicy
from mooncake_kv.replay.reference import HitStats
from mooncake_kv.replay.trace import Trace, hit_tokens


def _always(_key: str) -> bool:
    return True


def simulate(
    trace: Trace,
    capacity_blocks: int,
    policy: EvictionPolicy,
    *,
    progress: Callable[[int], None] | None = None,
) -> HitStats:
    """Replay ``trace`` against a cache of ``capacity_blocks`` unit-size blocks run by ``policy``."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    resident: set[str] = set()
    out = HitStats()
    bt = trace.block_tokens
    for n, req in enumerate(trace.requests, 1):
        keys = [str(h) for h in req.hash_ids]
        k = 0
        while k < len(keys) and keys[k] in resident:
            k += 1
        out.add(req.input_length, hit_tokens(k, bt, req.input_length), k)
        for key in keys[:k]:
            policy.on_access(key)
        # Like the store's put: reserve room for every missing block (evicting by policy), then
        # tell the policy about the new blocks, in order, once the whole batch is in.
        stored: list[tuple[str, str | None]] = []
        parent = keys[k - 1] if k else None
        for key in keys[k:]:
            if key not in resident and capacity_blocks > 0:
                while len(resident) >= capacity_blocks:
                    victims = policy.victims(1, _always)
                    if not victims:
                        break
                    for v in victims:
                        resident.discard(v)
                        policy.on_remove(v)
                        if len(resident) < capacity_blocks:
                            break
                if len(resident) < capacity_blocks:
                    resident.add(key)
                    stored.append((key, parent))
            parent = key
        for key, parent in stored:
            policy.on_insert(key, 1, parent)
        if progress is not None:
            progress(n)
    out.tier_hit_tokens["dram"] = out.hit_tokens
    return out
