"""Where a vLLM worker sits in its deployment: its TP/PP/DP position and its lookup endpoint name.

Every worker process of a deployment (each TP rank, PP stage and DP engine) receives the same
``kv_connector_extra_config``; :func:`rank_position` gives each one the position
:func:`mooncake_connector.ranks.rank_store_config` turns into its own SSD directory and DRAM segment.
:func:`lookup_name` names the lookup sockets of one DP engine, so DP engines never answer each
other's scheduler.

Called at connector construction. ``rank_position`` reads vLLM's parallel state, so it only works in
a worker after vLLM initialised its process groups; ``lookup_name`` reads only the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

from mooncake_connector.ranks import RankPosition

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig


def dp_position(parallel: ParallelConfig) -> tuple[int, int]:
    """(DP rank, DP size) of this engine.

    vLLM runs the DP engines of a dense model as independent engines: it sets their
    ``data_parallel_size`` to 1 and ``data_parallel_rank`` to 0, keeping the real rank only in
    ``data_parallel_index`` and the configured size only in ``elastic_ep_max_dp_size`` (which equals
    the configured DP size unless elastic EP is on). Both are read, so DP engine 0 is not mistaken
    for a single-rank deployment while DP engine 1 writes beside it.
    """
    dp_rank = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))
    dp_size = max(int(parallel.data_parallel_size), int(getattr(parallel, "elastic_ep_max_dp_size", 1) or 1),
                  dp_rank + 1)
    return dp_rank, dp_size


def rank_position(vllm_config: VllmConfig) -> RankPosition:
    """This worker's position (call in a worker process, after vLLM set up its process groups)."""
    parallel = vllm_config.parallel_config
    dp_rank, dp_size = dp_position(parallel)
    return RankPosition(tp_rank=get_tensor_model_parallel_rank(), tp_size=parallel.tensor_parallel_size,
                        pp_rank=get_pp_group().rank_in_group, pp_size=parallel.pipeline_parallel_size,
                        dp_rank=dp_rank, dp_size=dp_size)


def lookup_name(vllm_config: VllmConfig) -> str:
    """Name of this engine's lookup endpoints: the KV engine id plus the DP rank (vLLM appends the DP
    rank to the engine id for its own DP engines, but a configured ``engine_id`` is shared as given)."""
    dp_rank, _ = dp_position(vllm_config.parallel_config)
    return engine_name(vllm_config.kv_transfer_config.engine_id, dp_rank)


def engine_name(engine_id: str, dp_rank: int) -> str:
    """:func:`lookup_name` from its parts (vLLM's frontend knows each engine's index, its DP rank)."""
    return f"{engine_id}-dp{dp_rank}"
