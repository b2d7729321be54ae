"""What besides the token ids makes a vLLM request's KV differ: the extra keys of its chunks.

Called by :mod:`vllm_plugin.scheduler` (scheduler thread) when it extends a request's chain of
chunk hashes. Mirrors what vLLM's own prefix cache hashes into its blocks
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``), chunk by chunk:

- **LoRA**: the adapter's name and path (vLLM's ``lora_int_id`` is a per-server counter: after a
  restart another adapter can get the same id, and one adapter gets different ids on different
  servers), plus a stamp of the adapter's files, so an adapter replaced in place at the same path
  gets new keys after the restart that loads it. Every chunk.
- **Cache salt**: every chunk.
- **Multimodal items**: an item's identifier (vLLM's content hash) and its offset relative to the
  chunk, only in the chunks its placeholder tokens overlap (``mm_position``). A text prefix before
  the first image therefore keys exactly as the same text alone.
- **Prompt embeddings**: vLLM fills the token ids of ``prompt_embeds`` requests with zeros, so each
  chunk that holds embedded positions carries a hash of its slice of the embeddings (and, for a
  mixed prompt, of which positions are embeddings).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

from mooncake_connector.checkpoint import files_stamp

if TYPE_CHECKING:
    from vllm.v1.request import Request


@functools.lru_cache(maxsize=256)
def _adapter_stamp(lora_path: str, lora_int_id: int) -> str:
    # Keyed by the int id too: vLLM loads an adapter once per id for the life of the server, so the
    # files seen when the id first appears are the ones it runs.
    return files_stamp(lora_path) or ""


def request_extra_keys(request: Request) -> list[str]:
    """Extra keys of every chunk of ``request``: LoRA adapter (name, path, files) and cache salt."""
    extra: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        if not path:
            stamp = ""
        elif getattr(lora, "load_inplace", False):  # vLLM reloads the files for this request
            stamp = files_stamp(path) or ""
        else:
            stamp = _adapter_stamp(path, int(getattr(lora, "lora_int_id", 0)))
        extra.append(f"lora:{lora.lora_name}:{path}:{stamp}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extra.append(f"salt:{salt}")
    return extra


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).cpu().numpy())


def chunk_extra_keys(request: Request, first_chunk: int, end_chunk: int, chunk_tokens: int) -> list[list[str]]:
    """Per-chunk extra keys of chunks ``[first_chunk, end_chunk)`` of ``request`` (one list each,
    empty for a chunk with none): the multimodal items it overlaps, its prompt embeddings."""
    out: list[list[str]] = [[] for _ in range(first_chunk, end_chunk)]
    if end_chunk <= first_chunk:
        return out
    features: Sequence = getattr(request, "mm_features", None) or ()
    for feature in features:
        pos = feature.mm_position
        start, length = int(pos.offset), int(pos.length)
        if length <= 0:
            continue
        lo = max(first_chunk, start // chunk_tokens)
        hi = min(end_chunk, (start + length - 1) // chunk_tokens + 1)
        for c in range(lo, hi):
            out[c - first_chunk].append(f"mm:{feature.identifier}:{start - c * chunk_tokens}")
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        mask = getattr(request, "prompt_is_token_ids", None)
        n_embeds = int(embeds.shape[0])
        for c in range(first_chunk, min(end_chunk, -(-n_embeds // chunk_tokens))):
            lo, hi = c * chunk_tokens, min((c + 1) * chunk_tokens, n_embeds)
            h = xxhash.xxh3_128(_tensor_bytes(embeds[lo:hi]))
            h.update(str(embeds.dtype).encode())
            if mask is not None:
                h.update(bytes(bool(m) for m in mask[lo:hi]))
            out[c - first_chunk].append(f"embeds:{h.hexdigest()}")
    return out
