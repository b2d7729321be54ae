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


# The pool never holds fewer chunks than this, whatever staging_bytes says: a step can then still
# load a few chunks beside a few saves in flight.
MIN_STAGING_CHUNKS = 4


def _sizes(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> tuple[int, int, int]:
    """(pool bytes, recommended bytes, chunk bytes)."""
    chunk_bytes = geometry.chunk_layout(cfg.chunk_tokens).chunk_bytes
    batched = int(vllm_config.scheduler_config.max_num_batched_tokens)
    recommended = recommended_staging_bytes(chunk_bytes, cfg.chunk_tokens, batched)
    return max(min(cfg.staging_bytes, recommended), MIN_STAGING_CHUNKS * chunk_bytes), recommended, chunk_bytes


def staging_bytes(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """The worker's staging pool size: :func:`mooncake_connector.staging.recommended_staging_bytes`
    for this model's chunk size and vLLM's ``max_num_batched_tokens``, capped at ``staging_bytes``
    (host memory, pinned on a GPU, is the operator's to budget), and never below
    ``MIN_STAGING_CHUNKS`` chunks. The pool allocates lazily, so the bytes are only taken when that
    many transfers are in flight at once."""
    return _sizes(vllm_config, cfg, geometry)[0]


def staging_shortfall(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> str | None:
    """A warning for the log when the pool is smaller than recommended (None when it is not):
    what the smaller pool costs. Pure."""
    pool, recommended, chunk_bytes = _sizes(vllm_config, cfg, geometry)
    if pool >= recommended:
        return None
    chunks = pool // chunk_bytes
    raised = ""
    if pool > cfg.staging_bytes:
        raised = f" (raised from staging_bytes={cfg.staging_bytes} to {MIN_STAGING_CHUNKS} chunks)"
    return (f"staging pool of {pool} bytes{raised} holds {chunks} chunks of {chunk_bytes} bytes, below the "
            f"{recommended} bytes recommended for max_num_batched_tokens="
            f"{vllm_config.scheduler_config.max_num_batched_tokens}: saves and loads wait for staging "
            f"(at most load_timeout_s={cfg.load_timeout_s}), a save that still finds none is planned again, "
            f"and where loads go through staging (not from the store's slots), loads of several requests are "
            f"spread over steps and a prefix hit longer than {chunks} chunks loads {chunks} and computes the "
            f"rest. Raise staging_bytes to avoid this.")


def staging_chunks(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """Whole chunks the staging pool holds (at least one)."""
    chunk_bytes = geometry.chunk_layout(cfg.chunk_tokens).chunk_bytes
    return max(1, staging_bytes(vllm_config, cfg, geometry) // chunk_bytes)


def load_budget_chunks(vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> int:
    """Most chunk loads one step plans for several requests: half the staging pool (at least one),
    so a step's loads fit beside the saves still in flight; a hit that does not fit beside loads
    already planned waits for the next step (where it is asked first, alone)."""
    return max(1, staging_chunks(vllm_config, cfg, geometry) // 2)
