"""What besides the token ids makes a vLLM request's KV differ: the extra keys of its chunks.

Called by :mod:`vllm_plugin.scheduler` (scheduler thread) when it extends a request's chain of
chunk hashes. Mirrors what vLLM's own prefix cache hashes into its blocks
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``), chunk by chunk:

- **LoRA**: the adapter's name and path (vLLM's ``lora_int_id`` is a per-server counter: after a
  restart another adapter can get the same id, and one adapter gets different ids on different
  servers), plus a stamp of the adapter's files (:func:`adapter_stamp`), so an adapter replaced at
  the same path gets new keys. Every chunk.
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
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

from mooncake_connector.checkpoint import STAMPED_SUFFIXES, files_stamp, hub_snapshot
from mooncake_connector.keys import salt_extra_key

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _stat_signature(path: str) -> tuple | None:
    """What changes whenever a stamped file under ``path`` (a directory or a file) is written,
    replaced, added or removed: name, size, mtime, ctime (set by the kernel on every write, rename
    or utime, so a copy that preserves size and mtime still changes it), inode and link target.
    None when ``path`` is neither a file nor a directory. Blocking (``stat`` only)."""
    if os.path.isfile(path):
        entries = [path]
    elif os.path.isdir(path):
        try:
            entries = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(STAMPED_SUFFIXES)]
        except OSError:
            return None
    else:
        return None
    sig = []
    for full in entries:
        try:
            st = os.stat(full)
            target = os.readlink(full) if os.path.islink(full) else ""
        except OSError:
            continue
        sig.append((os.path.basename(full), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                    target))
    return tuple(sig)


@functools.lru_cache(maxsize=256)
def _stamp_of(path: str, signature: tuple) -> str:
    # Keyed by the files' stat signature: the (content-sampling) stamp is computed again only when
    # a file changed. vLLM reloads an evicted adapter from its path (LRUCacheWorkerLoRAManager), so
    # the files at the path now are the ones a request may run with.
    return files_stamp(path) or ""


def adapter_stamp(lora_path: str) -> str:
    """A stamp of the adapter vLLM loads for ``lora_path``, resolved as vLLM's
    ``get_adapter_absolute_path`` does: a local directory or file (``~`` expanded) by
    :func:`mooncake_connector.checkpoint.files_stamp`; otherwise a hub id, by the commit of its
    snapshot in the local Hugging Face cache (``hf:<commit>:<stamp>``). A hub id that is not cached
    here gets ``""``: its keys then carry only the id string (the caller adds the path), and an
    adapter re-published under that id shares them until the cache holds it. Blocking: ``stat`` of
    the adapter's files on every call, their content sample only when they changed."""
    path = os.path.expanduser(lora_path)
    sig = _stat_signature(path)
    if sig is not None:
        return _stamp_of(path, sig)
    snap = hub_snapshot(lora_path, None)
    if snap is None:
        return ""
    commit, snapshot_dir = snap
    snap_sig = _stat_signature(snapshot_dir)
    return f"hf:{commit}:{_stamp_of(snapshot_dir, snap_sig) if snap_sig is not None else ''}"


def request_extra_keys(request: Request) -> list[str]:
    """Extra keys of every chunk of ``request``: LoRA adapter (name, path, files) and cache salt."""
    extra: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        stamp = adapter_stamp(path) if path else ""
        extra.append(f"lora:{lora.lora_name}:{path}:{stamp}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extra.append(salt_extra_key(salt))
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
