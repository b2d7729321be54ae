"""What the connector needs to know about a vLLM deployment: its fingerprint and its KV geometry.

Both connector halves call this at construction (scheduler process and worker processes), from the
engine's construction thread. It reads only ``VllmConfig`` and ``KVCacheConfig``, so the scheduler
and every worker derive identical fingerprints without talking to each other.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec
import torch

from mooncake_connector.config import ConnectorConfig
from mooncake_connector.keys import ModelFingerprint
from mooncake_connector.layout import ChunkLayout, PageFormat
from store_backend.config import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM attention backend name -> how its pages hold K and V.
_PAGE_FORMATS = {
    "CPU_ATTN": PageFormat.KV_HALVES,
    "FLASH_ATTN": PageFormat.KV_INTERLEAVED,
    "TRITON_ATTN": PageFormat.KV_INTERLEAVED,
    "FLEX_ATTENTION": PageFormat.KV_INTERLEAVED,
    "FLASHINFER": PageFormat.KV_INTERLEAVED,
}


def page_format_for(backend_name: str) -> PageFormat:
    """The page format of a vLLM attention backend (raises ConfigError for one not known here)."""
    if backend_name in _PAGE_FORMATS:
        return _PAGE_FORMATS[backend_name]
    if "MLA" in backend_name:
        return PageFormat.LATENT
    raise ConfigError(
        f"attention backend {backend_name!r} is not supported by the tiered connector "
        f"(known: {sorted(_PAGE_FORMATS)} and MLA backends)"
    )


def natural_key(name: str) -> tuple:
    """Sort key that orders ``model.layers.10`` after ``model.layers.9``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


class KVGeometry(msgspec.Struct, frozen=True):
    """The engine's KV facts the connector needs, per shard."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype: str  # torch dtype name, e.g. "bfloat16"
    element_bytes: int
    is_mla: bool
    shard_count: int

    def chunk_layout(self, chunk_tokens: int) -> ChunkLayout:
        return ChunkLayout(
            num_layers=self.num_layers,
            chunk_tokens=chunk_tokens,
            num_heads=1 if self.is_mla else self.num_kv_heads,
            head_size=self.head_size,
            element_bytes=self.element_bytes,
            num_planes=1 if self.is_mla else 2,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)


def kv_layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """Layers that own KV memory (layers that reuse another's cache are not listed), in model order."""
    names = [name for t in kv_cache_config.kv_cache_tensors for name in t.layers]
    return sorted(dict.fromkeys(names), key=natural_key)


def kv_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVGeometry:
    """Read the KV geometry (raises ConfigError for layouts the connector cannot store)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the tiered connector supports models with one KV cache group, this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = getattr(spec, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unsupported KV cache spec {type(spec).__name__}")
    is_mla = bool(model.use_mla)
    head_size = int(getattr(spec, "head_size", model.get_head_size()))
    head_size_v = getattr(spec, "head_size_v", head_size)
    if not is_mla and head_size_v != head_size:
        raise ConfigError(f"K and V head sizes differ ({head_size} vs {head_size_v}); not supported")
    layers = kv_layer_names(kv_cache_config)
    return KVGeometry(
        block_size=int(spec.block_size),
        num_layers=len(layers),
        num_kv_heads=1 if is_mla else int(getattr(spec, "num_kv_heads", model.get_num_kv_heads(parallel))),
        head_size=head_size,
        kv_dtype=str(dtype).removeprefix("torch."),
        element_bytes=torch.empty((), dtype=dtype).element_size(),
        is_mla=is_mla,
        shard_count=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
    )


def fingerprint(vllm_config: VllmConfig, geometry: KVGeometry, cfg: ConnectorConfig,
                shard_index: int) -> ModelFingerprint:
    """The fingerprint of one KV shard (MLA: shard 0 only, since every rank holds the same latent)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    kv_dtype = geometry.kv_dtype if cache.cache_dtype == "auto" else f"{geometry.kv_dtype}:{cache.cache_dtype}"
    return ModelFingerprint(
        model_id=cfg.model_id or str(model.model),
        kv_dtype=kv_dtype,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        shard_index=0 if geometry.is_mla else shard_index,
        shard_count=1 if geometry.is_mla else geometry.shard_count,
        revision=cfg.revision or model.revision,
        quantization=model.quantization,
        is_mla=geometry.is_mla,
    )
