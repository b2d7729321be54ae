"""What the connector needs to know about a vLLM deployment: its fingerprint and its KV geometry.

Both connector halves call this at construction (scheduler process and worker processes), from the
engine's construction thread. It reads ``VllmConfig``, ``KVCacheConfig`` and the checkpoint's
files (``stat`` and a sparse content sample), so the scheduler and every worker derive identical
fingerprints without talking to each other.

Deployments the connector cannot store correctly are refused here, at start-up, with an error that
names the setting: more than one KV cache group, layers whose cache vLLM does not keep for every
token (sliding-window or chunked-local attention in every layer), decode or prefill context
parallelism, and a pipeline split whose KV layers do not follow vLLM's hidden-layer partition.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import msgspec
import torch
import xxhash
from vllm.distributed.utils import get_pp_indices
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from mooncake_connector.checkpoint import files_stamp, hub_snapshot
from mooncake_connector.config import ConnectorConfig
from mooncake_connector.keys import ModelFingerprint
from mooncake_connector.layout import ChunkLayout, PagedLayer, PageFormat
from store_backend.config import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

logger = logging.getLogger(__name__)

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


def _check_parallelism(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            raise ConfigError(
                f"{name}={size}: context parallelism splits each request's KV across ranks by token, "
                "which the tiered connector does not store (its chunks hold every token of a shard); "
                f"run with {name}=1 or without the connector")


def _check_spec(spec: KVCacheSpec, vllm_config: VllmConfig) -> None:
    """Only caches vLLM keeps for every token can be saved and loaded chunk by chunk."""
    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    for s in specs:
        if isinstance(s, SlidingWindowSpec):
            # Blocks that fall out of the window are handed back (vLLM's shared null block): a chunk
            # gathered then holds another request's or no KV. With a full-attention layer anywhere
            # in the model vLLM promotes window layers to full allocation and this never happens.
            raise ConfigError(
                f"every attention layer of {vllm_config.model_config.model} uses a sliding window "
                f"(sliding_window={s.sliding_window}); vLLM frees the blocks outside the window, so the "
                "tiered connector cannot store them. Start vLLM with --disable-sliding-window "
                "(disable_sliding_window=True) to keep every token's KV, or run without the connector")
        if isinstance(s, ChunkedLocalAttentionSpec):
            raise ConfigError(
                f"every attention layer of {vllm_config.model_config.model} uses chunked local attention "
                f"(attention_chunk_size={s.attention_chunk_size}); vLLM frees blocks of earlier chunks, so "
                "the tiered connector cannot store them; run it without the connector")
        if type(s) not in (FullAttentionSpec, MLAAttentionSpec):
            raise ConfigError(
                f"KV cache spec {type(s).__name__} is not supported by the tiered connector "
                "(full attention and MLA only)")


def kv_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVGeometry:
    """Read the KV geometry (raises ConfigError for layouts the connector cannot store)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the tiered connector supports models with one KV cache group, this one has {len(groups)}"
        )
    _check_parallelism(vllm_config)
    spec = groups[0].kv_cache_spec
    _check_spec(spec, vllm_config)
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


def weights_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> str | None:
    """What names the checkpoint's weights in the fingerprint, beside its revision.

    - ``revision`` or ``model_id`` set in the connector config: None. The operator names the model
      and its weights (e.g. to share one cache between copies at different paths, or with SGLang)
      and must change ``revision`` when the weights change.
    - A local checkpoint (directory or file): :func:`mooncake_connector.checkpoint.files_stamp` of
      it (names, sizes, mtimes and a sparse content sample of weights, configs and modelling
      code), so weights replaced at the same path get new keys.
    - A hub id: ``hf:<commit>:<stamp>`` of its snapshot in the local Hugging Face cache (the commit
      the revision resolved to); when it is not found there, None and a warning (the fingerprint
      then has the revision only).

    Blocking (``stat`` calls, at most 512 KiB read per file); called once per connector half.
    """
    if cfg.revision or cfg.model_id:
        return None
    model = vllm_config.model_config
    path = str(model.model)
    stamp = files_stamp(path)
    if stamp is not None:
        return stamp
    snap = hub_snapshot(path, model.revision, getattr(vllm_config.load_config, "download_dir", None))
    if snap is not None:
        commit, snapshot_dir = snap
        return f"hf:{commit}:{files_stamp(snapshot_dir)}"
    logger.warning("cannot identify the weights of %s (not a local path, not in the Hugging Face cache): "
                   "the KV fingerprint has only its revision %r; set the connector's `revision` and change it "
                   "when the weights change", path, model.revision)
    return None


# Model-config fields that cannot change the KV of a token: where the config was read from (the
# model id and the weights stamp name the checkpoint; a shared ``model_id`` must match across copies
# at different paths) and the transformers version that wrote it. Everything else is kept: when in
# doubt a field costs a cache miss, never a wrong token.
_CONFIG_FIELDS_IGNORED = frozenset({"_name_or_path", "transformers_version"})


def _config_doc(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _config_doc(v) for k, v in value.items() if k not in _CONFIG_FIELDS_IGNORED}
    if isinstance(value, (list, tuple)):
        return [_config_doc(v) for v in value]
    return value


def _hf_config_digest(hf_config: object) -> str:
    text = json.dumps(_config_doc(hf_config.to_dict()), sort_keys=True, separators=(",", ":"), default=str)  # type: ignore[attr-defined]
    return xxhash.xxh3_128_hexdigest(text.encode())


def draft_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> str | None:
    """What names a speculative-decoding draft model in the fingerprint; None without one.

    vLLM puts the attention layers of a draft that keeps KV (``draft_model``, EAGLE, MTP, dflash,
    hidden-state extraction: ``uses_draft_kv_cache()``) into the same KV cache config as the target's,
    and the connector saves and loads every layer there, so a chunk holds the draft's KV too: another
    draft (or new draft weights) must never load it. The identity is the method, the draft's model
    id, revision and quantization, a digest of its effective config and, unless the operator names
    the model (``model_id``/``revision``, see :func:`weights_identity`), a stamp of its weights files
    (for MTP the target's own checkpoint). Speculation without draft KV (n-gram, suffix) changes no
    byte of the KV: None, the keys stay the target's. Blocking like :func:`weights_identity`."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.uses_draft_kv_cache():
        return None
    draft = spec.draft_model_config
    doc: dict[str, object] = {"method": str(spec.method)}
    if draft is not None:
        doc.update(model=str(draft.model), revision=draft.revision, quantization=draft.quantization,
                   dtype=str(draft.dtype), config=_hf_config_digest(draft.hf_config))
        if not (cfg.revision or cfg.model_id):
            stamp = files_stamp(str(draft.model))
            if stamp is None:
                snap = hub_snapshot(str(draft.model), draft.revision,
                                    getattr(vllm_config.load_config, "download_dir", None))
                stamp = None if snap is None else f"hf:{snap[0]}:{files_stamp(snap[1])}"
            doc["weights"] = stamp
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def config_identity(vllm_config: VllmConfig) -> str:
    """A digest of the model config vLLM computes with: the effective ``hf_config`` (and
    ``hf_text_config`` when it is another object) after ``hf_overrides`` and vLLM's own updates
    (``to_dict()``, canonical JSON with sorted keys, :data:`_CONFIG_FIELDS_IGNORED` left out), the
    compute dtype and ``disable_sliding_window``. RoPE parameters, window sizes, norms and the like
    change the KV a token gets (K is stored after RoPE) without touching the weights files, and with
    ``model_id``/``revision`` set the weights are not stamped at all. Pure; cheap (one JSON dump)."""
    model = vllm_config.model_config
    doc: dict[str, object] = {
        "hf_config": _config_doc(model.hf_config.to_dict()),
        "dtype": str(model.dtype),
        "disable_sliding_window": bool(getattr(model, "disable_sliding_window", False)),
    }
    if model.hf_text_config is not model.hf_config:
        doc["hf_text_config"] = _config_doc(model.hf_text_config.to_dict())
    # default=str: a value JSON cannot hold (a dtype, an enum) is named by its text; a text that
    # differs between processes costs misses, never a wrong match.
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def stage_layer_counts(vllm_config: VllmConfig, geometry: KVGeometry, stage: int) -> list[int]:
    """KV layers of every pipeline stage, from vLLM's own partition of the hidden layers
    (``get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``); ``geometry`` was read on stage
    ``stage``. Raises ConfigError when that stage's KV layers do not match vLLM's partition (a
    model whose KV layers are not its hidden layers): the other stages' counts would be guesses."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1:
        return [geometry.num_layers]
    total = vllm_config.model_config.get_total_num_hidden_layers()
    counts = [end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))]
    if counts[stage] != geometry.num_layers:
        raise ConfigError(
            f"pipeline_parallel_size={pp}: stage {stage} holds {geometry.num_layers} KV layers but vLLM's "
            f"partition of {total} hidden layers gives it {counts[stage]} ({counts}); the tiered connector "
            "cannot derive the other stages' layouts for this model; run with pipeline_parallel_size=1")
    return counts


def fingerprint(vllm_config: VllmConfig, geometry: KVGeometry, cfg: ConnectorConfig,
                shard_index: int, *, num_layers: int | None = None, weights: str | None = None,
                epoch: int = 0, draft: str | None = None) -> ModelFingerprint:
    """The fingerprint of one KV shard (``shard_index = pp_rank * tp_size + tp_rank``).

    ``num_layers``: that shard's KV layers when ``geometry`` was read on another pipeline stage
    (see :func:`shard_fingerprints`). MLA: every TP rank of a stage holds the same latent, so the
    shard is the pipeline stage alone."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    kv_dtype = geometry.kv_dtype if cache.cache_dtype == "auto" else f"{geometry.kv_dtype}:{cache.cache_dtype}"
    if geometry.is_mla:
        index, count = shard_index // tp, max(1, geometry.shard_count // tp)
    else:
        index, count = shard_index, geometry.shard_count
    return ModelFingerprint(
        model_id=cfg.model_id or str(model.model),
        kv_dtype=kv_dtype,
        num_layers=geometry.num_layers if num_layers is None else num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_size=geometry.head_size,
        shard_index=index,
        shard_count=count,
        revision=cfg.revision or model.revision,
        quantization=model.quantization,
        is_mla=geometry.is_mla,
        weights=weights,
        epoch=epoch,
        # SGLang's backend cannot compute vLLM's effective config, and keys shared with it must
        # match: with the "sglang" scheme the operator's model_id/revision name the configuration.
        config=None if cfg.hash_scheme == "sglang" else config_identity(vllm_config),
        draft=draft,
    )


def shard_fingerprints(vllm_config: VllmConfig, geometry: KVGeometry, cfg: ConnectorConfig, *,
                       stage: int = 0, weights: str | None = None, epoch: int = 0) -> list[ModelFingerprint]:
    """Fingerprints of every KV shard (index ``pp_rank * tp_size + tp_rank``), each with its own
    stage's layer count; ``geometry`` was read on pipeline stage ``stage`` (the scheduler sees
    stage 0's), and the draft model's identity (:func:`draft_identity`). Raises ConfigError as
    :func:`stage_layer_counts`."""
    counts = stage_layer_counts(vllm_config, geometry, stage)
    tp = vllm_config.parallel_config.tensor_parallel_size
    draft = draft_identity(vllm_config, cfg)
    return [fingerprint(vllm_config, geometry, cfg, shard, num_layers=counts[shard // tp], weights=weights,
                        epoch=epoch, draft=draft)
            for shard in range(geometry.shard_count)]


def paged_layers(kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int, layout: ChunkLayout,
                 forward_context: dict[str, object]) -> tuple[list[PagedLayer], int]:
    """Each KV-owning layer's cache tensor wrapped in the page format of its attention backend, in
    ``layer_names`` order, and the kernel blocks per engine block. ConfigError names a layer whose
    tensor is missing, whose block count is not a multiple of ``num_blocks``, or that has no
    attention backend."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise ConfigError(f"KV cache tensors missing for layers {missing[:3]}")
    paged: list[PagedLayer] = []
    ratio = 1
    for name in layer_names:
        kv = kv_caches[name]
        if kv.shape[0] % num_blocks:
            raise ConfigError(f"layer {name}: {kv.shape[0]} cache blocks is not a multiple of {num_blocks}")
        ratio = kv.shape[0] // num_blocks
        layer = forward_context.get(name)
        if layer is None or not hasattr(layer, "attn_backend"):
            raise ConfigError(f"layer {name} has no attention backend to read its page format from")
        page_format = page_format_for(layer.attn_backend.get_name())  # type: ignore[attr-defined]
        paged.append(PagedLayer(kv, page_format, num_heads=layout.num_heads, head_size=layout.head_size))
    return paged, ratio
