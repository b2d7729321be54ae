"""Which embedded store each rank process of one engine opens.

Every rank process of an engine (vLLM's TP/PP/DP workers, SGLang's TP/PP/DP schedulers) receives
the same extra config, but an embedded store's SSD directory and named DRAM segment belong to one
process (the store refuses a second opener). :func:`rank_store_config` derives each rank's own
directory and segment name from its position, so ranks never share either by accident.

Pure functions, callable from any thread; used by both engine plugins at connector construction.
"""

from __future__ import annotations

import os

import msgspec

from store_backend.config import StoreConfig


class RankPosition(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one rank process sits in its engine's parallel layout (sizes >= 1, ranks in range)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("dp_rank", "dp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if s < 1 or not 0 <= r < s:
                raise ValueError(f"{rank} {r} not in [0, {size} {s})")

    @property
    def single(self) -> bool:
        """The engine runs one rank process only."""
        return self.tp_size * self.pp_size * self.dp_size == 1

    @property
    def suffix(self) -> str:
        """A name unique to this rank among its engine's ranks: ``dp<d>-tp<t>-pp<p>``."""
        return f"dp{self.dp_rank}-tp{self.tp_rank}-pp{self.pp_rank}"


def rank_store_config(store: StoreConfig, position: RankPosition, *, shared_ssd: bool = False) -> StoreConfig:
    """The store config rank ``position`` opens.

    A single-rank engine uses the paths as written (so another engine, or a restart with another
    engine, opens the same directory). With more than one rank, each rank gets
    ``<ssd.path>/<suffix>`` and ``<dram.shm_name>-<suffix>``; the configured SSD directory then
    holds one subdirectory per rank and nothing else. With ``shared_ssd`` the SSD directory is
    meant to be shared between processes (it is opened in shared mode) and is left as written; the
    DRAM segment is still per rank.
    """
    if position.single:
        return store
    changes: dict[str, object] = {}
    if store.ssd is not None and not shared_ssd:
        changes["ssd"] = msgspec.structs.replace(store.ssd, path=os.path.join(store.ssd.path, position.suffix))
    if store.dram.shm_name is not None:
        changes["dram"] = msgspec.structs.replace(store.dram, shm_name=f"{store.dram.shm_name}-{position.suffix}")
    return msgspec.structs.replace(store, **changes) if changes else store
