"""vLLM's own objects a worker half is built from, without an engine: the ``VllmConfig`` of the
tiny model with this connector, the ``KVCacheConfig`` of a two-layer CPU cache, and vLLM's
single-process distributed groups (which the worker half reads its rank from)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

from tests.ports import free_port
from vllm_plugin.model_info import KVGeometry

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
GEOMETRY = KVGeometry(block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="float32",
                      element_bytes=4, is_mla=False, shard_count=1)


def connector_config(tiny_model: Path, extra: dict[str, Any], *, kv_role: str = "kv_both",
                     **engine_args: Any) -> VllmConfig:
    """The tiny model's engine config with this connector (``extra``: its extra config)."""
    policy = engine_args.pop("kv_load_failure_policy", None)
    ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role=kv_role,
                           kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra,
                           **({"kv_load_failure_policy": policy} if policy else {}))
    args = {"max_model_len": 4096, **engine_args}
    return EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, block_size=BLOCK, dtype="float32",
                      enforce_eager=True, kv_transfer_config=ktc, **args).create_engine_config()


def cache_config(num_blocks: int) -> KVCacheConfig:
    """A float32 cache of ``num_blocks`` blocks for LAYERS, as vLLM's CPU backend lays it out."""
    page_bytes = 2 * BLOCK * GEOMETRY.num_kv_heads * GEOMETRY.head_size * 4
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=2 * num_blocks * page_bytes, layers=LAYERS,
                                        layer_stride=num_blocks * page_bytes, block_stride=page_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


@contextlib.contextmanager
def single_process_groups(vllm_config: VllmConfig) -> Iterator[None]:
    """vLLM's distributed groups of one process (made here unless they exist; then torn down)."""
    owns_groups = not model_parallel_is_initialized()
    with set_current_vllm_config(vllm_config):
        if owns_groups:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        if owns_groups:
            destroy_model_parallel()
            destroy_distributed_environment()
