"""Replay a request trace through a real :class:`~store_backend.store.TieredStore`.

The store is the one engines use (same tiers, allocator, eviction policy, offload and promotion
engine); only the payloads are shrunk: a block of ``block_tokens`` tokens is
``block_tokens * bytes_per_token`` bytes and capacities are given in tokens, so a replay of a
100M-token working set fits in a few hundred MB.

For each request, as an engine does around prefill:

1. ``exists(keys)`` gives the leading blocks stored in any tier; ``tier_of`` says which tier;
2. ``get_into`` loads them (a DRAM hit is an access for the eviction policy; an SSD hit may promote);
   the hit is the leading run of blocks actually loaded, in tokens, capped at the input length;
3. ``put`` stores the missing blocks with ``parents=`` the previous block's key, so a prefix-aware
   policy sees the tree. With an SSD tier the driver waits for promotions after the load and for
   offloads after the put (``flush``), so the background work never races the request's own and
   every run gives the same numbers.

Keys are ``str(hash_id)``: the traces' hash ids are already prefix-chained.

Single-threaded on the caller's thread (the store runs its own workers); the store is created,
started and closed inside :func:`replay_store`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from store_backend.config import StoreConfig, config_from_dict
from mooncake_kv.replay.reference import HitStats
from mooncake_kv.replay.trace import Trace
from store_backend.ssd.record import record_bytes
from store_backend.store import TieredStore
from store_backend.types import Status

logger = logging.getLogger(__name__)

_OFFSET_DATA_START = 4096  # the offset backend's superblock, before the first record


class ReplaySetup(msgspec.Struct, frozen=True):
    """One store configuration to replay: a policy, a DRAM capacity and an optional SSD tier."""

    policy: str
    dram_tokens: int
    ssd_tokens: int = 0
    ssd_backend: str = "offset"
    bytes_per_token: int = 1

    @property
    def label(self) -> str:
        ssd = f"+ssd{self.ssd_tokens}" if self.ssd_tokens else ""
        return f"{self.policy}@dram{self.dram_tokens}{ssd}"


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_bytes(block_tokens: int, bytes_per_token: int) -> int:
    return block_tokens * bytes_per_token


def store_config(setup: ReplaySetup, block_tokens: int, ssd_dir: str | None) -> StoreConfig:
    """The StoreConfig holding exactly ``dram_tokens // block_tokens`` blocks in DRAM (and as many
    blocks as ``ssd_tokens`` make on SSD): capacities are whole blocks times what one block takes
    in the tier (its payload rounded to the DRAM alignment, or its SSD record)."""
    if setup.dram_tokens < block_tokens:
        raise ValueError(f"dram_tokens ({setup.dram_tokens}) must hold at least one {block_tokens}-token block")
    if setup.bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {setup.bytes_per_token}")
    payload = block_bytes(block_tokens, setup.bytes_per_token)
    align = _pow2_at_least(payload)
    data: dict = {
        "dram": {
            "capacity_bytes": (setup.dram_tokens // block_tokens) * align,
            "alignment_bytes": align,
            "eviction_policy": setup.policy,
        },
        "offload": {"policy": "eager"},
    }
    if setup.ssd_tokens:
        if ssd_dir is None:
            raise ValueError("an SSD tier needs a directory")
        if setup.ssd_backend not in ("offset", "file"):
            raise ValueError(f"replay sizes the SSD tier for the offset and file backends, not {setup.ssd_backend!r}")
        blocks = setup.ssd_tokens // block_tokens
        extra = _OFFSET_DATA_START if setup.ssd_backend == "offset" else 0
        data["ssd"] = {
            "path": ssd_dir,
            "backend": setup.ssd_backend,
            "capacity_bytes": blocks * record_bytes(payload) + extra,
            "direct_io": False,
            "io_engine": "posix",
            "bucket_eviction": "lru",
        }
    return config_from_dict(data)


def default_ssd_root() -> str:
    """A RAM-backed directory when there is one (the replay measures policy, not the disk)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def replay_store(
    trace: Trace,
    setup: ReplaySetup,
    *,
    ssd_root: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> HitStats:
    """Replay ``trace`` through a fresh store built from ``setup``; returns hits per tier.

    ``tier_hit_tokens`` has ``dram`` and ``ssd`` (tokens of leading hits served by each tier), and
    the result's ``extra`` the store's final metrics. Blocks on the calling thread; a temporary SSD
    directory under ``ssd_root`` is removed afterwards.
    """
    bt = trace.block_tokens
    payload_len = block_bytes(bt, setup.bytes_per_token)
    payload = bytes(payload_len)
    max_blocks = max((len(r.hash_ids) for r in trace.requests), default=0)
    scratch = bytearray(max(1, max_blocks) * payload_len)
    scratch_view = memoryview(scratch)
    out_bufs = [scratch_view[i * payload_len:(i + 1) * payload_len] for i in range(max_blocks)]
    stats = HitStats(tier_hit_tokens={"dram": 0, "ssd": 0})
    with tempfile.TemporaryDirectory(prefix="mkv-replay-", dir=ssd_root or default_ssd_root()) as tmp:
        cfg = store_config(setup, bt, str(Path(tmp) / "ssd") if setup.ssd_tokens else None)
        with TieredStore(cfg) as store:
            has_ssd = cfg.ssd is not None
            for n, req in enumerate(trace.requests, 1):
                keys = [str(h) for h in req.hash_ids]
                k = store.exists(keys)
                tiers = store.tier_of(keys[:k]) if (has_ssd and k) else ["dram"] * k
                loaded = 0
                if k:
                    results = store.get_into(keys[:k], out_bufs[:k])
                    while loaded < k and results[loaded].status is Status.OK:
                        loaded += 1
                    if has_ssd:
                        store.flush()  # promotions land before this request's put, in the same order every run
                hit = min(loaded * bt, req.input_length)
                stats.add(req.input_length, hit, loaded)
                for i in range(loaded):
                    tokens = min(bt, max(0, req.input_length - i * bt))
                    tier = tiers[i] or "dram"
                    stats.tier_hit_tokens[tier] = stats.tier_hit_tokens.get(tier, 0) + tokens
                missing = keys[loaded:]
                if missing:
                    parents = [keys[loaded - 1] if loaded else None, *missing[:-1]]
                    store.put(missing, [payload] * len(missing), parents=parents)
                if has_ssd:
                    store.flush()  # offloads and promotions done before the next request: no races
                if progress is not None:
                    progress(n)
            stats.store_metrics = store.metrics()
    return stats
