"""How much staging memory a worker uses, and how many chunk loads one step may plan.

Both halves compute the same numbers from the same config (the scheduler to budget loads, each
worker to size its pool), so they agree without talking. Pure functions; called at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_connector.staging import recommended_staging_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from mooncake_connector.config import ConnectorConfig
    from vllm_plugin.model_info import KVGeometry


def staging_bytes(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """The worker's staging pool size: ``staging_bytes`` as configured, raised to
    :func:`mooncake_connector.staging.recommended_staging_bytes` for this model's chunk size and
    vLLM's ``max_num_batched_tokens`` when it is smaller (the configured value is a floor). The pool
    allocates lazily, so the bytes are only taken when that many transfers are in flight at once."""
    chunk_bytes = geometry.chunk_layout(cfg.chunk_tokens).chunk_bytes
    batched = int(vllm_config.scheduler_config.max_num_batched_tokens)
    return max(cfg.staging_bytes, recommended_staging_bytes(chunk_bytes, cfg.chunk_tokens, batched))


def staging_chunks(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """Whole chunks the staging pool holds (at least one)."""
    chunk_bytes = geometry.chunk_layout(cfg.chunk_tokens).chunk_bytes
    return max(1, staging_bytes(vllm_config, cfg, geometry) // chunk_bytes)


def load_budget_chunks(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """Most chunk loads one step plans for several requests: half the staging pool (at least one),
    so a step's loads fit beside the saves still in flight; a hit that does not fit beside loads
    already planned waits for the next step (where it is asked first, alone)."""
    return max(1, staging_chunks(vllm_config, cfg, geometry) // 2)
