"""Where one SGLang rank process sits in its server's parallel layout, for the per-rank store config.

SGLang builds one ``HiCacheStorageConfig`` per scheduler process. It names the TP and PP rank and,
with DP attention, the attention-DP rank (``dp_rank``; ``tp_rank`` is then local to the attention
group), but not how many DP ranks there are, and nothing at all for data-parallel replicas
(``--dp-size`` without DP attention: every replica gets ``dp_rank`` 0). SGLang's runtime context
(``sglang.srt.runtime_context.get_parallel()``, published by the server in every scheduler process)
has both: the replica index and count (``dp_rank``, ``dp_size``) and the attention-DP width
(``attn_dp_size``). :func:`rank_position` combines the two sources; the position then picks the
rank's own SSD directory and DRAM segment (:func:`mooncake_connector.ranks.rank_store_config`).

Called once per backend, from SGLang's scheduler thread.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.runtime_context import get_parallel

from mooncake_connector.ranks import RankPosition


def _published_dp() -> tuple[int, int, int] | None:
    """(replica rank, replica count, attention-DP size) from SGLang's runtime context, or None when
    no server published one (a backend built by hand, outside a server)."""
    try:
        parallel = get_parallel()
        replica = parallel.dp_rank
        return (0 if replica is None else int(replica)), int(parallel.dp_size), int(parallel.attn_dp_size)
    except (RuntimeError, ValueError, AttributeError):  # nothing published in this process
        return None


def rank_position(storage_config: Any) -> RankPosition:
    """The position of the rank that SGLang built ``storage_config`` (a HiCacheStorageConfig) for.

    The DP coordinate is ``replica * attn_dp_size + attn_dp_rank`` of ``dp_size * attn_dp_size``
    (SGLang runs DP attention inside one replica, so one of the two factors is 1). Without a
    published runtime context the DP count is unknown: the position is then ``dp_rank`` of
    ``dp_rank + 1``, so a rank with ``dp_rank > 0`` still gets its own paths; with ``dp_rank`` 0 and
    one TP/PP rank the configured paths are used as written, as for a single-rank server.
    """
    attn_dp_rank = int(getattr(storage_config, "dp_rank", 0) or 0)
    published = _published_dp()
    if published is None:
        dp_rank, dp_size = attn_dp_rank, attn_dp_rank + 1
    else:
        replica, replicas, attn_dp_size = published
        attn_dp_size = max(attn_dp_size, attn_dp_rank + 1)  # never below what SGLang passed
        dp_rank, dp_size = replica * attn_dp_size + attn_dp_rank, max(replicas, replica + 1) * attn_dp_size
    return RankPosition(tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size,
                        pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size,
                        dp_rank=dp_rank, dp_size=dp_size)
